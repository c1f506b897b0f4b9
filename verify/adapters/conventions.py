"""What an adapter declares about the implementation behind it, and one attention step through any adapter.

Shape legend: ``B`` rows, ``S`` positions per row, ``L`` local rows of a rank, ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

__all__ = ["DOCUMENTS", "DOC_ID_SOURCES", "MASK4D", "OURS", "PADDING", "Conventions", "Unsupported", "attention_step"]

DOCUMENTS = {
    "run": "a document is a maximal run of one non-zero id",
    "id": "a document is every token of a row sharing one non-zero id (a reused id continues its document)",
    "row": "a row is one causal sequence: doc ids and padding are not read",
}
PADDING = {
    "zero": "padding rows output exactly 0 and padding keys/values get 0 gradient",
    "free": "padding rows are not zeroed (their outputs and gradients are left unspecified)",
}
DOC_ID_SOURCES = {
    "packed": "_packed_seq_ids [B, S]: the documents' ids (0 = padding; an id may come back later in a row)",
    "mask4d": "a 4-D boolean attention_mask [B, 1, S, S] of the documents",
    "mask2d": "a 2-D attention_mask [B, S] holding the documents' ids",
    "positions": "position_ids [B, S] restarting at 0 at every document (no ids, no mask)",
}
MASK4D = {
    "documents": "a 4-D attention_mask gives the documents",
    "validity": "a 4-D attention_mask is read through its diagonal: real vs padding only (one document)",
}


class Unsupported(ValueError):
    """Raised by an adapter for an input its implementation does not take (a declared refusal)."""


@dataclass(frozen=True)
class Conventions:
    """An implementation's contract where it may differ from ours. ``document``, ``padding`` and ``mask4d``
    change what the verifier compares (a failing case is re-checked under them); the other fields document
    the adapter and select the conformance matrix."""

    document: str = "run"
    padding: str = "zero"
    mask4d: str = "documents"
    batch_rows: str = "any"  # e.g. "1 (B > 1 refused with ValueError)"
    cp1: str = "CP with one rank"
    dtypes: tuple[str, ...] = ("float64", "float32", "bfloat16", "float16")
    devices: tuple[str, ...] = ("cpu", "cuda")
    layouts: str = "contiguous shards"
    windows: str = "none"
    notes: tuple[str, ...] = ()
    # the doc-id sources it reads: "packed" (_packed_seq_ids), "mask4d" (a 4-D boolean mask), "mask2d" (a 2-D mask of
    # ids), "positions" (restarting position_ids); the verifier builds no case from a source not declared
    sources: tuple[str, ...] = ("packed", "mask4d", "mask2d", "positions")

    def __post_init__(self) -> None:
        for field, table in (("document", DOCUMENTS), ("padding", PADDING), ("mask4d", MASK4D)):
            if getattr(self, field) not in table:
                raise ValueError(f"Conventions.{field}: expected one of {sorted(table)}, got {getattr(self, field)!r}")
        bad = [s for s in self.sources if s not in DOC_ID_SOURCES]
        if bad or not self.sources:
            raise ValueError(f"Conventions.sources: expected a non-empty subset of {sorted(DOC_ID_SOURCES)}, got {self.sources!r}")

    def differences(self) -> list[str]:
        """The comparison conventions that differ from ours, as ``field=value``."""
        return [f"{f}={getattr(self, f)}" for f in ("document", "padding", "mask4d") if getattr(self, f) != getattr(OURS, f)]

    def describe(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["document"] = f"{self.document}: {DOCUMENTS[self.document]}"
        d["padding"] = f"{self.padding}: {PADDING[self.padding]}"
        d["mask4d"] = f"{self.mask4d}: {MASK4D[self.mask4d]}"
        return d


OURS = Conventions(windows="(left, 0) causal windows")


def attention_step(
    module: ModuleType,
    cp_mesh,
    q_BHSD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    doc_ids_BS: Tensor,
    grad_out_BHSD: Tensor | None = None,
) -> dict[str, Tensor]:
    """Forward and backward of one attention call through ``module`` (an adapter or ``blockdiag_dist``) on
    this rank's shard of a packed batch.

    The full ``q, k, v`` (identical on every rank) travel as one ``inputs_embeds [B, S, (Hq + 2 Hkv) D]``
    through the module's batch function, so they are sharded (and their gradients flow back) the way the
    module shards any batch. ``grad_out_BHSD`` (full, default ones) is the upstream gradient of the output.

    Returns ``out [B, Hq, L, D]`` (this rank's rows), ``positions [B, L]`` (their global positions),
    ``padding [B, L]`` (True = padding row) and ``dq, dk, dv`` (full shapes: this rank's contribution; the sum
    over ranks is the gradient).
    """
    B, Hq, S, D = q_BHSD.shape
    Hkv = k_BHSD.shape[1]
    leaves = [t.detach().clone().requires_grad_() for t in (q_BHSD, k_BHSD, v_BHSD)]
    packed = torch.cat([t.transpose(1, 2).reshape(B, S, -1) for t in leaves], dim=-1)
    batch: dict[str, Any] = {
        "inputs_embeds": packed,
        "position_ids": torch.arange(S, device=packed.device).expand(B, S).clone(),
        "_packed_seq_ids": doc_ids_BS.to(packed.device),
    }
    made = module.make_cp_blockdiag_batch_and_ctx(cp_mesh, None, batch)
    train_ctx, batch = made[0], made[1]
    x = batch["inputs_embeds"]
    L = x.shape[1]
    q, k, v = x.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = (t.reshape(B, L, -1, D).transpose(1, 2) for t in (q, k, v))
    positions = batch["position_ids"]
    positions = positions[0] if positions.dim() == 3 else positions
    grad = torch.ones(B, Hq, S, D, dtype=q.dtype, device=q.device) if grad_out_BHSD is None else grad_out_BHSD
    with train_ctx():
        out = module.cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)
        padding = batch["padding_mask"].to(torch.bool)
        g = grad.transpose(1, 2)[torch.arange(B, device=q.device)[:, None], positions.clamp(0, S - 1)].transpose(1, 2)
        out.backward(torch.where(padding[:, None, :, None], 0.0, g))
    return {"out": out.detach(), "positions": positions, "padding": padding,
            "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
