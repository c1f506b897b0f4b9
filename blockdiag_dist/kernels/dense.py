"""Dense kernel: one SDPA call over all local query tokens against the whole key buffer, with a bool mask
rebuilt from flat ids. Simple and obviously right; it materializes the ``[Tq, Tk]`` mask, so it is meant for
small shards and as a second opinion on the varlen kernel.

Shape legend: Tq local query tokens (B * L), Tk key-buffer tokens, Hq / Hkv heads, D / Dv head dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._stock import stock_sdpa

__all__ = ["DenseMeta", "dense_attention", "plan_dense"]


@dataclass(frozen=True, eq=False)
class DenseMeta:
    mask: Tensor  # bool [1, 1, Tq, Tk]
    pad_q: Tensor  # bool [Tq, 1, 1], True on padding queries

    def to(self, device: torch.device) -> DenseMeta:
        return DenseMeta(self.mask.to(device), self.pad_q.to(device))


def plan_dense(q_flat: Tensor, k_flat: Tensor, segments: Tensor, padded_len: int, window_left: int) -> DenseMeta:
    """Mask of local queries (flat ids ``[Tq]``) against the key buffer (flat ids ``[Tk]``)."""
    seg_q, seg_k = segments[q_flat][:, None], segments[k_flat][None, :]
    pos_q, pos_k = (q_flat % padded_len)[:, None], (k_flat % padded_len)[None, :]
    mask = (seg_q == seg_k) & (seg_q != 0) & (pos_k <= pos_q)
    if window_left >= 0:
        mask &= pos_k >= pos_q - window_left
    return DenseMeta(mask=mask[None, None], pad_q=(segments[q_flat] == 0)[:, None, None])


def dense_attention(
    q_tok: Tensor, kv_buf: Tensor, meta: DenseMeta, *, heads_kv: int, dim_v: int, dropout_p: float, scale: float | None
) -> Tensor:
    """``q_tok [Tq, Hq, D]`` and the key buffer ``kv_buf [Tk, Hkv * (D + Dv)]`` (keys then values per token)
    -> ``[Tq, Hq, Dv]``; padding rows exactly 0."""
    kd = heads_kv * q_tok.shape[2]
    q = q_tok.transpose(0, 1)[None]  # [1, Hq, Tq, D]
    k = kv_buf[:, :kd].unflatten(1, (heads_kv, -1)).transpose(0, 1)[None]
    v = kv_buf[:, kd:].unflatten(1, (heads_kv, dim_v)).transpose(0, 1)[None]
    gqa = q.shape[1] != k.shape[1]
    out = stock_sdpa(q, k, v, attn_mask=meta.mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    return torch.where(meta.pad_q, 0.0, out[0].transpose(0, 1))
