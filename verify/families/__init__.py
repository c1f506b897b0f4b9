"""The verifier's side of the mixer families: one :class:`MixerSpec` per ``--layer`` (see
:data:`blockdiag_dist.families.FAMILIES`, whose entries name the distributed function and the float64 reference
the spec's block is run with).

A spec says what :mod:`verify.mixers` needs to judge one family on one rank: the block around the mixer (weights,
projections to the mixer's inputs, the call, the features the loss reads), how the reference and an
implementation's function are called, the summary elements a rank receives by its plan, the case's label and
replay arguments, and the family's planted bugs (``mutants``: bug name -> a factory of the wrong function; the
bugs are described in :data:`verify.mutants._mixers.MIXER_BUGS` and reached as ``verify.mutants.mixer_<bug>``).

Main entry: :data:`SPECS` (layer -> spec), in the order of the matrix's layers. Adding a family: one module here
with its ``SPEC``, listed below (docs/hybrid.md, "Adding a mixer family").

Shape legend: B rows, S (or L, a rank's) positions, E hidden size; the other sizes are :func:`sizes`'.
"""

from __future__ import annotations

from . import conv, gated_delta, kda, lightning, mamba1, mamba2, sparse
from ._spec import VOCAB, MixerSpec, sizes, weight_maker

__all__ = ["SPECS", "VOCAB", "MixerSpec", "sizes", "spec", "weight_maker"]

SPECS: dict[str, MixerSpec] = {s.layer: s for s in (conv.SPEC, gated_delta.SPEC, mamba2.SPEC, kda.SPEC, sparse.SPEC,
                                                    mamba1.SPEC, lightning.SPEC)}


def spec(layer: str) -> MixerSpec:
    """The spec of ``--layer layer``; ``ValueError`` naming the layers when none."""
    if layer not in SPECS:
        raise ValueError(f"layer: expected a mixer layer of {tuple(SPECS)}, got {layer!r}")
    return SPECS[layer]
