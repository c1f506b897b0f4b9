"""Dense kernel: one SDPA call per step, batched by row: each local row's queries against that row's keys in the
key buffer, with a bool mask rebuilt from flat ids. Simple and obviously right; it materializes a
``[B, L, Sk]`` mask, so it is meant for small shards and as a second opinion on the varlen kernel.

Each query's score row holds only its own row's keys, as in stock SDPA run per batch row, never the keys of
every local row: torch's fused CPU kernel computes ``exp`` with a vectorized approximation on whole vector
lanes and with libm on a row's remainder, so its float32 gradient error depends on how many keys a score row
has; flattening all rows into one ``[Tq, Tk]`` call gave peaked softmax rows the error of a longer row.

On the CPU below float64, where a row's ``L`` queries meet more key slots (``Sk > L``: under CP), it computes
explicit scores (:mod:`.explicit`, the accuracy of SDPA's math backend) instead: on such a call
torch's fused CPU kernel loses float32 precision in the values' gradient when a query sees few keys and its
scores are large (torch 2.13.0+cpu, one allowed key per query, scores of standard deviation ~16: ``dV`` error
1e-5 at 16 queries x 17 keys against 1.2e-7 at 16 x 16 and on the math backend; ``python -m verify fuzz
--seed 20261207`` found it at CP 2, 28x the stock call's error on the whole row).

Where every real query sees exactly one key (documents of one token, chunks of one position, a window of 0), its
softmax is exactly 1: the kernel returns that key's value and gives q and k exactly 0 gradient, as the varlen kernel
does, where torch's fused kernel would give them its rounding (``python -m verify fuzz --seed 20261221``: a
one-token document at CP 4, dq 3.7e-6 through the fused CPU kernel, and the gradient of ``inputs_embeds`` over the
verifier's float32 limit by 1.4x).

Shape legend: B local rows of L query tokens (Tq = B * L), Tk key-buffer tokens, Sk the most keys of one row
(rows with fewer keys are padded with masked slots), Hq / Hkv heads, D / Dv head dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._stock import stock_sdpa
from .explicit import explicit_attention, graph_zero, own_key_attention

__all__ = ["DenseMeta", "dense_attention", "plan_dense", "sdpa_keeps_accuracy"]


@dataclass(frozen=True, eq=False)
class DenseMeta:
    mask: Tensor  # bool [B, 1, L, Sk]: the pairs attention allows (none on a padding query)
    key_index: Tensor  # int64 [B * Sk] key-buffer row of each key slot (padded slots repeat row 0, masked)
    pad_q: Tensor  # bool [B, 1, L, 1], True on padding queries
    # bool [B, 1, L, Sk]: what SDPA gets, ``mask`` plus the first key slot of every padding query: no row is
    # fully masked (CUDA backends may return NaN there, in the output or the gradients); the padding rows'
    # outputs are replaced by 0, so their gradient is exactly 0 and so is what they give their key
    sdpa_mask: Tensor
    # int64 [B, 1, L, 1]: the key slot of each query's only key, when every real query sees exactly one (0 on a
    # padding query); None otherwise
    one_key: Tensor | None = None

    def to(self, device: torch.device) -> DenseMeta:
        one_key = None if self.one_key is None else self.one_key.to(device)
        return DenseMeta(self.mask.to(device), self.key_index.to(device), self.pad_q.to(device), self.sdpa_mask.to(device),
                         one_key)

    def pairs(self) -> Tensor:
        """int64 ``[n, 2]``: (local query row, key-buffer row) of every pair the mask allows."""
        b, _, i, j = self.mask.nonzero().unbind(1)
        L, Sk = self.mask.shape[2], self.mask.shape[3]
        return torch.stack([b * L + i, self.key_index[b * Sk + j]], 1)


def plan_dense(q_flat: Tensor, k_flat: Tensor, segments: Tensor, padded_len: int, window_left: int,
               labels: Tensor | None = None, whole_blocks: bool = False) -> DenseMeta:
    """Per-row mask of local queries (flat ids ``[Tq]``, row after row) against the keys of their row in the
    key buffer (flat ids ``[Tk]``, in buffer order). ``labels`` (int64 ``[B * Sp]``, 0 = none): bidirectional
    blocks, a query also sees the later keys of its block, and with ``whole_blocks`` every key of it, beyond the
    window too (:mod:`blockdiag_dist.bidirectional`)."""
    B = segments.numel() // padded_len
    L = q_flat.numel() // B
    q_row = (q_flat // padded_len).view(B, L)
    if not bool((q_row == torch.arange(B)[:, None]).all()):
        raise ValueError(f"plan_dense: expected local queries as {B} rows of {L} tokens each of its own row, got rows {q_row.tolist()}")
    k_row = k_flat // padded_len
    counts = torch.bincount(k_row, minlength=B)
    Sk = int(counts.max()) if k_flat.numel() else 0
    order = torch.sort(k_row, stable=True).indices  # buffer rows grouped by row, buffer order kept
    slot = torch.arange(k_flat.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    key_index = torch.zeros(B, Sk, dtype=torch.int64)
    valid = torch.zeros(B, Sk, dtype=torch.bool)
    key_index[k_row[order], slot] = order
    valid[k_row[order], slot] = True
    kf = k_flat[key_index]  # [B, Sk]
    seg_q, seg_k = segments[q_flat].view(B, L, 1), segments[kf].view(B, 1, Sk)
    pos_q, pos_k = (q_flat % padded_len).view(B, L, 1), (kf % padded_len).view(B, 1, Sk)
    mask = (seg_q == seg_k) & (seg_q != 0) & (pos_k <= pos_q) & valid[:, None, :]
    if window_left >= 0:
        mask &= pos_k >= pos_q - window_left
    if labels is not None:
        lab_q, lab_k = labels[q_flat].view(B, L, 1), labels[kf].view(B, 1, Sk)
        same = (lab_q == lab_k) & (lab_q != 0) & valid[:, None, :]
        mask |= same if whole_blocks else same & (pos_k > pos_q)
    pad_q = (seg_q == 0)[:, None]
    sdpa_mask = mask[:, None] | (pad_q & (torch.arange(Sk) == 0))
    seen = mask.sum(-1)  # [B, L]: keys each query sees (0 on a padding query)
    one_key = None
    if bool((seen == 1).any()) and bool(((seen == 1) | pad_q[:, 0, :, 0]).all()):
        one_key = mask.to(torch.uint8).argmax(-1)[:, None, :, None]
    return DenseMeta(mask=mask[:, None], key_index=key_index.flatten(), pad_q=pad_q, sdpa_mask=sdpa_mask, one_key=one_key)


def sdpa_keeps_accuracy(q: Tensor, queries: int, keys: int) -> bool:
    """Whether the dense kernel's SDPA call of ``queries`` rows against ``keys`` slots is as accurate as the stock
    call on the whole row (square): not on the CPU below float64 when it has more keys than queries (see the
    module docstring), where the kernel computes explicit scores instead; at CP 1 its calls are the stock ones."""
    return not (q.device.type == "cpu" and q.dtype != torch.float64 and keys > queries)


def dense_attention(
    q_tok: Tensor, kv_buf: Tensor, meta: DenseMeta, *, heads_kv: int, dim_v: int, dropout_p: float, scale: float | None,
    sinks: Tensor | None = None, softcap: float | None = None,
) -> Tensor:
    """``q_tok [Tq, Hq, D]`` and the key buffer ``kv_buf [Tk, Hkv * (D + Dv)]`` (keys then values per token)
    -> ``[Tq, Hq, Dv]``; padding rows exactly 0, padded key slots and masked keys exactly 0 gradient. With
    ``sinks [Hq]`` or a ``softcap``, and on the CPU below float64 where a row has more key slots than queries,
    explicit scores (:mod:`.explicit`) in place of SDPA. Where every real query sees exactly one key (``meta.one_key``)
    and there is no dropout, that key's value, with no kernel call (with sinks, weighed by
    :func:`.explicit.own_key_attention`)."""
    B, _, L, Sk = meta.mask.shape
    Hq, D = q_tok.shape[1], q_tok.shape[2]
    kd = heads_kv * D
    q = q_tok.view(B, L, Hq, D).transpose(1, 2)  # [B, Hq, L, D]
    rows = kv_buf.index_select(0, meta.key_index).view(B, Sk, -1)
    k = rows[..., :kd].unflatten(2, (heads_kv, D)).transpose(1, 2)  # [B, Hkv, Sk, D]
    v = rows[..., kd:].unflatten(2, (heads_kv, dim_v)).transpose(1, 2)
    if meta.one_key is not None and dropout_p == 0:
        g = Hq // heads_kv
        own = v.gather(2, meta.one_key.expand(B, heads_kv, L, dim_v)).repeat_interleave(g, dim=1)
        if sinks is None:  # a softmax of one (capped) score is exactly 1, and q gets exactly 0 gradient, as through
            out = own + graph_zero(q)  # any other path (k through the key buffer)
        else:  # the key's weight beside its sink, precise in both tails
            k_own = k.gather(2, meta.one_key.expand(B, heads_kv, L, D)).repeat_interleave(g, dim=1)
            out = own_key_attention(q, k_own, own, sinks.view(1, Hq, 1), scale, softcap)
    elif sinks is not None or softcap is not None or not sdpa_keeps_accuracy(q, L, Sk):
        out = explicit_attention(q, k, v, meta.mask, scale=scale, softcap=softcap, sinks=sinks, dropout_p=dropout_p)
    else:
        out = stock_sdpa(q, k, v, attn_mask=meta.sdpa_mask, dropout_p=dropout_p, scale=scale, enable_gqa=Hq != heads_kv)
    return torch.where(meta.pad_q, 0.0, out).transpose(1, 2).reshape(B * L, Hq, dim_v)
