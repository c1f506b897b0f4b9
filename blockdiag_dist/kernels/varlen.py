"""Varlen kernel: attention per document piece, with no ``[Tq, Tk]`` mask.

A *piece* is a maximal run of a rank's query tokens that are consecutive positions of one document. Its keys
are the positions ``[max(doc_start, first - left), last]`` of that document, gathered from the key buffer.

Pieces are batched so that many small documents cost one SDPA call, not one Python call each:

- a piece whose keys are exactly its own queries (no earlier part on another rank, no binding window) is
  *square*: it is right-padded to a size class and run with ``is_causal=True``. Padding sits after every real
  row, so causal attention never lets a real query see it, and no mask is needed;
- every other piece (its document started on an earlier rank, or a window cuts it) gets an explicit
  bottom-right-aligned causal mask, in buckets by (query size class, key size class).

Padded slots index a real row of the same piece, so everything stays finite; their outputs are dropped and
their gradients are exactly 0. On CUDA with flash-attn installed (fp16/bf16, D == Dv), pieces go to
``flash_attn_varlen_func`` instead (bottom-right causal alignment, native GQA and windows).

Shape legend: Tq local query tokens (B * L), Tk key-buffer tokens, P pieces, n pieces in a bucket,
Lq / Lk a bucket's padded query / key length, Hq / Hkv heads, D / Dv head dims.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._stock import stock_sdpa

__all__ = ["VarlenMeta", "plan_varlen", "size_class", "varlen_attention"]

EXACT_ABOVE = 1024  # pieces longer than this run at their exact length


def size_class(n: Tensor) -> Tensor:
    """Round lengths up to a size class: multiples of 16 up to 128, then 1/8 of the enclosing power of two,
    exact above ``EXACT_ABOVE``. Padding wastes at most ~1/8 of a piece's length.

    >>> size_class(torch.tensor([1, 16, 17, 130, 600, 1000, 1500]))
    tensor([  16,   16,   32,  144,  640, 1024, 1500])
    """
    n = n.to(torch.int64)
    step = (2 ** torch.floor(torch.log2(n.clamp_min(1).double())).to(torch.int64) // 8).clamp_min(16)
    rounded = (n + step - 1) // step * step
    return torch.where(n > EXACT_ABOVE, n, rounded)


@dataclass(frozen=True, eq=False)
class Bucket:
    q_index: Tensor  # int64 [n, Lq] rows of q_tok
    k_index: Tensor  # int64 [n, Lk] rows of the key buffer
    mask: Tensor | None  # bool [n, 1, Lq, Lk]; None = square pieces, is_causal

    def to(self, device: torch.device) -> Bucket:
        return Bucket(self.q_index.to(device), self.k_index.to(device), None if self.mask is None else self.mask.to(device))


@dataclass(frozen=True, eq=False)
class VarlenMeta:
    buckets: tuple[Bucket, ...]
    q_gather: Tensor  # int64: every bucket's q_index, flattened and concatenated (one gather for all)
    k_gather: Tensor  # int64: likewise for k_index
    out_rows: Tensor  # int64: for every bucket slot (same order), its query row, or Tq for a padded slot
    pad_rows: Tensor  # int64: local rows of padding queries (their outputs are 0)
    piece_q: Tensor  # int64 [P, 2] (first local query row, length), on the host
    piece_k: Tensor  # int64 [P, 2] (first key flat id, length), on the host
    key_lut: Tensor = field(repr=False)  # int64 [B * Sp] key-buffer row of each flat id (-1 = absent), host
    num_queries: int = 0
    window_left: int = -1
    _flash_cache: dict = field(default_factory=dict, repr=False)

    def to(self, device: torch.device) -> VarlenMeta:
        return VarlenMeta(
            buckets=tuple(b.to(device) for b in self.buckets),
            q_gather=self.q_gather.to(device),
            k_gather=self.k_gather.to(device),
            out_rows=self.out_rows.to(device),
            pad_rows=self.pad_rows.to(device),
            piece_q=self.piece_q,
            piece_k=self.piece_k,
            key_lut=self.key_lut,
            num_queries=self.num_queries,
            window_left=self.window_left,
        )

    def flash_meta(self, device: torch.device) -> dict:
        """cu_seqlens-style metadata for flash-attn's varlen function, built once per device."""
        cached = self._flash_cache.get(device)
        if cached is None:
            lens_q, lens_k = self.piece_q[:, 1], self.piece_k[:, 1]
            q_rows = _ranges(self.piece_q[:, 0], lens_q)
            k_rows = self.key_lut[_ranges(self.piece_k[:, 0], lens_k)]
            out_index = torch.full((self.num_queries,), q_rows.numel(), dtype=torch.int64)
            out_index[q_rows] = torch.arange(q_rows.numel())
            cu_q = torch.nn.functional.pad(torch.cumsum(lens_q, 0), (1, 0)).to(torch.int32)
            cu_k = torch.nn.functional.pad(torch.cumsum(lens_k, 0), (1, 0)).to(torch.int32)
            tensors = {"q_rows": q_rows, "k_rows": k_rows, "out_index": out_index, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
            cached = {k: v.to(device) for k, v in tensors.items()}
            cached["max_seqlen_q"] = int(lens_q.max()) if lens_q.numel() else 0
            cached["max_seqlen_k"] = int(lens_k.max()) if lens_k.numel() else 0
            cached = self._flash_cache.setdefault(device, cached)
        return cached


def _ranges(starts: Tensor, lens: Tensor) -> Tensor:
    """Concatenation of ``arange(s, s + n)`` for each (s, n)."""
    offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    return torch.repeat_interleave(starts, lens) + offsets


def plan_varlen(
    q_flat: Tensor, k_flat: Tensor, segments: Tensor, doc_starts: Tensor, padded_len: int, window_left: int
) -> VarlenMeta:
    """Pieces and buckets for local queries (flat ids ``[Tq]``) against a key buffer (flat ids ``[Tk]``)."""
    Tq = q_flat.numel()
    seg_q = segments[q_flat]
    pos_q = q_flat % padded_len
    real = seg_q != 0
    prev_seg = torch.nn.functional.pad(seg_q[:-1], (1, 0), value=0)
    prev_pos = torch.nn.functional.pad(pos_q[:-1], (1, 0), value=-2)
    first = real & ((seg_q != prev_seg) | (pos_q != prev_pos + 1))
    p_start = first.nonzero().flatten()  # [P] first local row of each piece
    piece_of = torch.cumsum(first, 0) - 1
    p_len = torch.bincount(piece_of[real], minlength=p_start.numel())
    p_flat0 = q_flat[p_start]  # flat id of each piece's first query
    p_qfirst = p_flat0 % padded_len
    p_dstart = doc_starts[p_flat0]
    p_kfirst = p_dstart if window_left < 0 else torch.maximum(p_dstart, p_qfirst - window_left)
    p_klen = p_qfirst + p_len - p_kfirst
    p_kflat0 = p_flat0 - p_qfirst + p_kfirst

    key_lut = torch.full((segments.numel(),), -1, dtype=torch.int64)
    key_lut[k_flat] = torch.arange(k_flat.numel())

    masked = (p_klen != p_len) | ((window_left >= 0) & (window_left < p_len - 1))
    cq, ck = size_class(p_len), size_class(p_klen)
    ck = torch.where(masked, ck, cq)
    group_key = (masked.long() << 62) | (cq << 31) | ck  # sizes < 2**31
    keys, group_of = torch.unique(group_key, return_inverse=True)

    buckets: list[Bucket] = []
    slot_rows: list[Tensor] = []
    for g, key in enumerate(keys.tolist()):
        is_masked, lq, lk = key >> 62, (key >> 31) & (2**31 - 1), key & (2**31 - 1)
        idx = (group_of == g).nonzero().flatten()
        n = idx.numel()
        a = torch.arange(lq)[None, :]
        c = torch.arange(lk)[None, :]
        qlen, klen = p_len[idx, None], p_klen[idx, None]
        q_index = p_start[idx, None] + torch.minimum(a, qlen - 1)
        k_index = key_lut[p_kflat0[idx, None] + torch.minimum(c, klen - 1)]
        assert bool((k_index >= 0).all()), "varlen plan: a piece's key is missing from the key buffer"
        mask = None
        if is_masked:
            qpos = (p_qfirst[idx, None] + a)[:, :, None]
            kpos = (p_kfirst[idx, None] + c)[:, None, :]
            valid_q = (a < qlen)[:, :, None]
            m = valid_q & (c < klen)[:, None, :] & (kpos <= qpos)
            if window_left >= 0:
                m &= kpos >= qpos - window_left
            m |= ~valid_q & (c == 0)[:, None, :]  # padded query slots see one real key: finite, then dropped
            mask = m[:, None]
        valid = a < qlen
        buckets.append(Bucket(q_index=q_index, k_index=k_index, mask=mask))
        slot_rows.append(torch.where(valid, q_index, Tq).flatten())
    empty = torch.zeros(0, dtype=torch.int64)
    out_rows = torch.cat(slot_rows) if slot_rows else empty
    written = torch.bincount(out_rows[out_rows < Tq], minlength=Tq)
    assert bool((written[real] == 1).all()) and bool((written[~real] == 0).all()), "varlen plan: a query row is not written exactly once"
    return VarlenMeta(
        buckets=tuple(buckets),
        q_gather=torch.cat([b.q_index.flatten() for b in buckets]) if buckets else empty,
        k_gather=torch.cat([b.k_index.flatten() for b in buckets]) if buckets else empty,
        out_rows=out_rows,
        pad_rows=(~real).nonzero().flatten(),
        piece_q=torch.stack([p_start, p_len], 1),
        piece_k=torch.stack([p_kflat0, p_klen], 1),
        key_lut=key_lut,
        num_queries=Tq,
        window_left=window_left,
    )


@functools.lru_cache(maxsize=1)
def _flash_varlen_fn():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return flash_attn_varlen_func


def flash_unusable_reason(q_tok: Tensor, dim: int, dim_v: int) -> str | None:
    """Why flash-attn's varlen function cannot run these tensors (None when it can)."""
    if q_tok.device.type != "cuda":
        return f"device is {q_tok.device.type}, flash-attn needs cuda"
    if q_tok.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype is {q_tok.dtype}, flash-attn needs float16 or bfloat16"
    if dim != dim_v:
        return f"D={dim} != Dv={dim_v}"
    if _flash_varlen_fn() is None:
        return "flash_attn is not importable"
    return None


# ---- gathers and scatter with one pass each way (autograd's own would zero-fill full-size buffers per bucket)
class _GatherQueries(torch.autograd.Function):
    """``q_tok [Tq, Hq, D]`` -> per bucket ``[n, Hq, Lq, D]`` (views of one gather); backward: one scatter-add."""

    @staticmethod
    def forward(ctx, q_tok: Tensor, index: Tensor, shapes: list[tuple[int, int]]):
        ctx.save_for_backward(index)
        ctx.shapes, ctx.rows = shapes, q_tok.shape[0]
        g = q_tok.index_select(0, index)
        outs, o = [], 0
        for n, lq in shapes:
            outs.append(g[o : o + n * lq].view(n, lq, *q_tok.shape[1:]).transpose(1, 2))
            o += n * lq
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        (index,) = ctx.saved_tensors
        shape = next(g for g in grads if g is not None).shape
        out = next(g for g in grads if g is not None).new_zeros((ctx.rows, shape[1], shape[3]))
        o = 0
        for grad, (n, lq) in zip(grads, ctx.shapes):
            if grad is not None:
                out.index_add_(0, index[o : o + n * lq], grad.transpose(1, 2).reshape(n * lq, shape[1], shape[3]))
            o += n * lq
        return out, None, None


class _GatherKeysValues(torch.autograd.Function):
    """Key buffer ``kv_buf [Tk, Hkv * (D + Dv)]`` -> per bucket ``k [n, Hkv, Lk, D]`` and ``v [n, Hkv, Lk, Dv]``
    (views of one gather); backward: one zero-fill and one scatter-add per half, no per-bucket fills."""

    @staticmethod
    def forward(ctx, kv_buf: Tensor, index: Tensor, lens: list[tuple[int, int]], heads_kv: int, dim: int):
        ctx.save_for_backward(index)
        ctx.lens, ctx.buf_shape, ctx.kd = lens, kv_buf.shape, heads_kv * dim
        g = kv_buf.index_select(0, index)
        outs, o = [], 0
        for n, lk in lens:
            rows = g[o : o + n * lk].unflatten(0, (n, lk))
            outs.append(rows[..., : ctx.kd].unflatten(2, (heads_kv, dim)).transpose(1, 2))
            outs.append(rows[..., ctx.kd :].unflatten(2, (heads_kv, -1)).transpose(1, 2))
            o += n * lk
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        (index,) = ctx.saved_tensors
        out = next(g for g in grads if g is not None).new_zeros(ctx.buf_shape)
        k_half, v_half = out[:, : ctx.kd], out[:, ctx.kd :]
        o = 0
        for b, (n, lk) in enumerate(ctx.lens):
            idx = index[o : o + n * lk]
            for grad, half in ((grads[2 * b], k_half), (grads[2 * b + 1], v_half)):
                if grad is not None:
                    half.index_add_(0, idx, grad.transpose(1, 2).reshape(n * lk, -1))
            o += n * lk
        return out, None, None, None, None


class _ScatterOutputs(torch.autograd.Function):
    """Per-bucket outputs ``[n, Hq, Lq, Dv]`` -> ``[Tq, Hq, Dv]`` in token order; padding queries exactly 0.
    Padded slots write to a spare row that is dropped; backward gathers each bucket's rows back."""

    @staticmethod
    def forward(ctx, rows: Tensor, pad_rows: Tensor, num_queries: int, *outs: Tensor):
        ctx.save_for_backward(rows)
        ctx.shapes = [o.shape for o in outs]
        hq, dv = outs[0].shape[1], outs[0].shape[3]
        out = outs[0].new_empty((num_queries + 1, hq, dv))
        o = 0
        for t in outs:
            n, _, lq, _ = t.shape
            out.index_copy_(0, rows[o : o + n * lq], t.transpose(1, 2).reshape(n * lq, hq, dv))
            o += n * lq
        out.index_fill_(0, pad_rows, 0.0)
        # the first rows over the same storage, as a tensor rather than a view: autograd forbids in-place ops
        # on views made inside a custom Function, and the caller may modify the attention output in place
        return out.new_empty(0).set_(out.untyped_storage(), 0, (num_queries, hq, dv), (hq * dv, dv, 1))

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        spare = grad.shape[0]
        grads, o = [], 0
        for n, hq, lq, dv in ctx.shapes:
            r = rows[o : o + n * lq]
            g = grad.index_select(0, r.clamp(max=spare - 1)).masked_fill_((r == spare)[:, None, None], 0.0)
            grads.append(g.view(n, lq, hq, dv).transpose(1, 2))
            o += n * lq
        return (None, None, None, *grads)


def varlen_attention(
    q_tok: Tensor,
    kv_buf: Tensor,
    meta: VarlenMeta,
    *,
    heads_kv: int,
    dim_v: int,
    dropout_p: float,
    scale: float | None,
    use_flash: bool = False,
) -> Tensor:
    """``q_tok [Tq, Hq, D]`` and the key buffer ``kv_buf [Tk, Hkv * (D + Dv)]`` (keys then values per token)
    -> ``[Tq, Hq, Dv]``; padding rows exactly 0.

    One gather for all queries, one for all keys and values, one scatter for all outputs, whatever the number
    of buckets (and one pass each in backward).
    """
    Hq, D = q_tok.shape[1], q_tok.shape[2]
    if use_flash:
        kd = heads_kv * D
        k_buf, v_buf = kv_buf[:, :kd].unflatten(1, (heads_kv, D)), kv_buf[:, kd:].unflatten(1, (heads_kv, dim_v))
        return _flash_varlen(q_tok, k_buf, v_buf, meta, dropout_p=dropout_p, scale=scale)
    if not meta.buckets:  # this rank holds only padding: zeros that still reach q and the key buffer
        return _zero_rows(q_tok, kv_buf, meta.num_queries, Hq, dim_v)
    gqa = Hq != heads_kv
    qs = _GatherQueries.apply(q_tok, meta.q_gather, [b.q_index.shape for b in meta.buckets])
    kvs = _GatherKeysValues.apply(kv_buf, meta.k_gather, [b.k_index.shape for b in meta.buckets], heads_kv, D)
    outs = [
        stock_sdpa(q, k, v, attn_mask=b.mask, dropout_p=dropout_p, is_causal=b.mask is None, scale=scale, enable_gqa=gqa)
        for b, q, k, v in zip(meta.buckets, qs, kvs[0::2], kvs[1::2])
    ]
    return _ScatterOutputs.apply(meta.out_rows, meta.pad_rows, meta.num_queries, *outs)


def _zero_rows(q_tok: Tensor, kv_buf: Tensor, rows: int, Hq: int, Dv: int) -> Tensor:
    """Exact zeros ``[rows, Hq, Dv]`` that still reach q and the key buffer in the graph (with exactly 0
    gradient), so that a rank holding only padding runs the exchange's backward like every other rank."""
    anchor = q_tok[:1, :1, :1].sum() + kv_buf[:1, :1].sum()
    zero = torch.where(torch.zeros((), dtype=torch.bool, device=q_tok.device), anchor, 0.0)
    return zero.expand(rows, Hq, Dv).clone(memory_format=torch.contiguous_format)  # writable, like other ranks' output


def _flash_varlen(q_tok, k_buf, v_buf, meta: VarlenMeta, *, dropout_p: float, scale: float | None) -> Tensor:
    fm = meta.flash_meta(q_tok.device)
    out = _flash_varlen_fn()(
        q_tok.index_select(0, fm["q_rows"]),
        k_buf.index_select(0, fm["k_rows"]),
        v_buf.index_select(0, fm["k_rows"]),
        fm["cu_seqlens_q"],
        fm["cu_seqlens_k"],
        fm["max_seqlen_q"],
        fm["max_seqlen_k"],
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=True,
        window_size=(meta.window_left, 0),
    )
    return torch.cat([out, out.new_zeros((1,) + tuple(out.shape[1:]))]).index_select(0, fm["out_index"])
