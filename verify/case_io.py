"""What one case exchanges with an implementation and how its results are judged: the batch it gives the
implementation's batch function (:func:`impl_batch`), per-quantity errors and verdicts (:class:`Metrics`, the
rule of :mod:`verify.tolerances`), and a quantity summed over the ranks' partial contributions
(:func:`summed_over_ranks`). Shared by the attention cases (:mod:`verify.runner`) and the mixer cases
(:mod:`verify.mixers`).

Shape legend: B rows, S sequence length, H hidden size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from .cases import Case
from .tolerances import judge

__all__ = ["Metrics", "failed_row_text", "impl_batch", "summed_over_ranks"]


def impl_batch(case: Case, inputs: dict[str, Tensor], x: Tensor, device: torch.device) -> dict[str, Any]:
    """The batch a case gives the implementation's batch function: ``inputs_embeds`` ``x [B, S, H]``, labels,
    positions and the documents in the case's source (``_packed_seq_ids``, a 2-D mask of ids, or a 4-D boolean
    mask)."""
    B, S = case.batch_size, case.seq_len
    ids = inputs["doc_ids"].to(device)
    batch: dict[str, Any] = {
        "inputs_embeds": x,
        "labels": inputs["labels"].to(device),
        "position_ids": torch.arange(S, device=device).expand(B, S).clone(),
    }
    if case.source == "packed":
        batch["_packed_seq_ids"] = ids
    elif case.source == "mask2d":
        batch["attention_mask"] = ids
    else:
        batch["attention_mask"] = DocLayout.from_doc_ids(ids.cpu()).materialize_mask().to(device)
    return batch


def summed_over_ranks(per_rank: list[dict], label: str, like: Tensor) -> Tensor | None:
    """The sum, in float64 and rank order, of every rank's partial ``label`` (``info["partials"]``), shaped like
    ``like``; None when no rank's part received a gradient."""
    parts = [info["partials"][label] for info in per_rank if info["partials"].get(label) is not None]
    if not parts:
        return None
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return torch.from_numpy(total).view_as(like)


def failed_row_text(name: str, row: dict[str, Any]) -> str:
    """One failed quantity in words: ``dq: err 3e-05 > limit 1e-06 on rank 1``, with its reason when it has one; a
    row failed for its reason alone (its error within the limit) says that first."""
    err, limit, rank, why = row["err"], row["limit"], row.get("rank"), row.get("why")
    if why and err <= limit:
        return f"{name}: {why}, on rank {rank} (err {err:.3g} within limit {limit:.3g})"
    return f"{name}: err {err:.3g} > limit {limit:.3g} on rank {rank}" + (f" ({why})" if why else "")


class Metrics:
    """Per-quantity errors and verdicts. ``scale`` is the largest reference magnitude of the quantity, or of
    its group when larger: grads of q and k are exactly 0 under a window of 0 (a softmax over one key), so
    their own magnitude cannot scale rounding noise; the group's (q, k, v) can."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.rows: dict[str, dict[str, Any]] = {}

    def close(
        self, name: str, got: Tensor | None, ref: Tensor, bases: dict[str, Tensor] | None, group_scale: float = 0.0,
        used: str | None = None,
    ) -> None:
        """``bases``: the baseline's value of the quantity per SDPA backend; ``used``: the backend the
        implementation ran on, whose baseline error it inherits."""
        if got is None:
            self.rows[name] = {"err": math.inf, "scale": 0.0, "limit": 0.0, "ok": False, "why": "no gradient reached it"}
            return
        got64, ref64 = got.detach().double().cpu(), ref.detach().double().cpu()
        if got64.shape != ref64.shape:
            self.rows[name] = {"err": math.inf, "scale": 0.0, "limit": 0.0, "ok": False,
                               "why": f"shape {tuple(got64.shape)} != reference {tuple(ref64.shape)}"}
            return
        err = (got64 - ref64).abs().max().item() if ref64.numel() else 0.0
        if math.isnan(err):
            err = math.inf
        scale = max(ref64.abs().max().item() if ref64.numel() else 0.0, group_scale)
        by_backend = {
            b: (t.detach().double().cpu() - ref64).abs().max().item() if ref64.numel() else 0.0
            for b, t in (bases or {}).items()
        }
        worst = max(by_backend, key=by_backend.get) if by_backend else None
        base_err = by_backend.get(worst)
        limit, ok = judge(self.dtype, err, scale, base_err)
        self.rows[name] = {"err": err, "scale": scale, "limit": limit, "ok": ok, "base": base_err}
        if by_backend:
            self.rows[name].update(base_backend=worst, base_by_backend=by_backend, inherited=by_backend.get(used))

    def on_every_rank(self, label: str, per_rank: list[dict]) -> None:
        """A parameter's gradient must reach it on every rank, 0 where the rank's rows do not use it: each CP
        rank's gradient is a partial sum reduced over the ranks by the data-parallel wrapper, and a rank without
        one breaks that reduction (FSDP2 reduce-scatters only the parameters that have one, so the ranks' sizes
        differ; DDP without ``find_unused_parameters`` raises at the next step). Fails the row ``label`` naming
        the ranks whose part of it never received a gradient (no rank at all is :meth:`close`'s "no gradient
        reached it")."""
        missing = [info.get("rank", r) for r, info in enumerate(per_rank) if info["partials"].get(label) is None]
        if missing and len(missing) < len(per_rank):
            self.rows[label].update(ok=False, why=f"no gradient on rank(s) {missing} of {len(per_rank)}: each rank must "
                                                 "give every parameter one, 0 where its rows do not use it")

    def exact_zero(self, name: str, got: Tensor | None) -> None:
        if got is None:
            self.rows[name] = {"err": math.inf, "scale": 0.0, "limit": 0.0, "ok": False, "why": "no gradient reached it"}
            return
        vals = got.detach().double().cpu()
        err = vals.abs().max().item() if vals.numel() else 0.0
        err = math.inf if math.isnan(err) else err
        self.rows[name] = {"err": err, "scale": 0.0, "limit": 0.0, "ok": err == 0.0, "exact": True}

    def equal(self, name: str, got: int, expected: int) -> None:
        self.rows[name] = {"err": float(abs(got - expected)), "scale": float(expected), "limit": 0.0,
                           "ok": got == expected, "got": got, "expected": expected}
