"""The record each mixer family's verifier spec fills in (:class:`MixerSpec`) and what the specs share (see
:mod:`verify.families`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["VOCAB", "MixerSpec", "sizes", "weight_maker"]

VOCAB = 11  # the read-out's classes


def sizes(case) -> dict[str, int]:
    """The block's sizes from the case's heads and dim (each family reads the ones it needs)."""
    return {"E": case.hidden, "C": case.hq * case.dim, "Hv": case.hq, "Hk": case.hkv, "K": case.dim, "V": case.dim + 1,
            "H": case.hq, "G": case.hkv, "Dh": case.dim, "N": case.dim + 1, "F": case.dim + 2, "Hi": case.hkv,
            "D": case.dim, "Dv": case.dim + 1}


def weight_maker(g: torch.Generator) -> Callable[..., Tensor]:
    """``w(*shape, fan=None)``: float64 normal weights scaled by ``fan ** -0.5`` (default: the first dim)."""

    def w(*shape: int, fan: int | None = None) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(fan or shape[0])

    return w


@dataclass(frozen=True)
class MixerSpec:
    """One family's block and planted bugs for :mod:`verify.mixers` (see the module docstring).

    - ``weight_names``: the block's weights, ``"wo"`` (the read-out to the vocabulary) last;
    - ``weights(case, w, n) -> {name: float64 tensor}`` in that order (``w`` from :func:`weight_maker`, ``n`` from
      :func:`sizes`);
    - ``block(case, x, ws, mix, n) -> (inputs, out, feats)``: the mixer's inputs (``{name: tensor}``, their
      gradients compared per rank), its output, and the ``[B, L, F]`` features the read-out ``wo [F, VOCAB]`` reads;
    - ``reference_mix(reference, ids, dtype, *, case)`` / ``impl_mix(fn, *, case, batch, device, dtype)``: the
      ``mix`` the block calls, from the family's reference (on the full rows, doc ids ``ids``) or an implementation's
      function (``batch``: this rank's sharded batch, for inputs drawn per position outside the block, as the DSA
      indexer's);
    - ``received(case, plan_state, rank, n)``: the elements this rank's mixer receives per forward by the plan
      (None when the plan moves nothing);
    - ``exchange``: what crosses ranks, ``"summary"`` (a recurrence's state), ``"history"`` (a convolution's
      previous tokens: the tokens that arrived are checked against the reference mask) or ``"keys"`` (earlier
      tokens moved by the attention's exchange, not the mixers');
    - ``check_exchange(case, state, rank, m, calls, n) -> mode``: for a family whose traffic is not the mixers'
      (``received`` None), its own check of the step's traffic on metrics ``m`` (``calls`` forwards), returning the
      exchange mode reported for the case;
    - ``label(case)``: the kind part of the case's label; ``args(case)``: its replay arguments beyond ``--layer``;
    - ``layouts_per_cp``: None, the matrix meets every named layout at every CP size; ``n``, ``n`` named layouts per
      CP size, rotating, so that every named layout is met at some CP size (a family whose distributed part is
      another's: its plan, folds and exchange are :func:`~blockdiag_dist.mixers.run_recurrence`'s, judged in
      full by the families already there; its own part, the scan and the summary, shows on any layout whose
      documents cross ranks).
    """

    layer: str
    inputs: tuple[str, ...]
    weight_names: tuple[str, ...]
    weights: Callable[[Any, Callable, dict], dict[str, Tensor]]
    block: Callable
    reference_mix: Callable
    impl_mix: Callable
    received: Callable
    label: Callable[[Any], str]
    exchange: str = "summary"
    args: Callable[[Any], list[str]] = lambda case: []
    check_exchange: Callable | None = None
    mutants: dict[str, Callable[[], Callable]] = field(default_factory=dict)
    layouts_per_cp: int | None = None

    @property
    def family(self):
        from blockdiag_dist.families import family_of_layer

        return family_of_layer(self.layer)

    @property
    def function_name(self) -> str:
        """The distributed function's name, read on an implementation module (``gated_delta_rule``, ...)."""
        return self.family.function_name
