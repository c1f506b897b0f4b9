"""Varlen kernel: attention per document piece, with no ``[Tq, Tk]`` mask in the hot path.

A *piece* is a maximal run of a rank's query tokens that are consecutive positions of one document. Its keys
are the positions ``[max(doc_start, first - left), last]`` of that document, gathered from the key buffer.

Every piece is cut into *blocks* that torch's fused attention runs without a mask, and the blocks of a query
are merged by log-sum-exp (the ring-attention merge):

- the *square* block: the piece's queries against its own positions, top-left causal;
- a *prefix* block when the document started before the piece (on another rank): the queries against the
  keys before the first query, unmasked, at the prefix's exact length;
- under a window that binds, the piece is cut into chunks of ``left`` positions aligned to the document
  start; a chunk is a causal square on its own positions plus, on the ``left`` positions before it, a band
  that is causal once queries and keys are both taken in reverse order (query ``t`` sees key ``j`` iff
  ``j >= t``), so it needs no mask either (measured: 11-17x faster than one masked block per piece for
  windows of 16-128 on a 2048-token document). A windowed piece with at most ``BAND_MIN`` keys runs as one
  masked block at its exact size instead, as stock SDPA would run it.

Blocks of one kind and size class are batched into one fused call, so many small documents cost one call,
not one each. Queries and keys are right-padded to the size class; a padded query slot repeats a real row and
its output is dropped; a padded key slot is seen only by padded query slots. The backward runs each block's
backward with the merged output and logsumexp (autograd cannot: it does not carry gradients through the fused
op's logsumexp output).

The fused op (``aten._scaled_dot_product_flash_attention_for_cpu``) takes CPU tensors with ``D == Dv`` and no
dropout. Anything else runs the *masked* plan: pieces with a bottom-right-aligned causal (and window) mask,
through torch's SDPA and autograd. On CUDA with flash-attn installed, pieces go to ``flash_attn_varlen_func``
instead (bottom-right causal alignment, native GQA, windows and soft-cap) whenever every precondition flash-attn
checks holds (:func:`flash_unusable_reason`: sm80+, fp16/bf16, D == Dv <= 256, no dropout with a soft-cap, at
least one piece); a rank holding only padding never calls it.

Shape legend: Tq local query tokens (B * L), Tk key-buffer tokens, P pieces, N blocks, n blocks in a bucket,
Lq / Lk a bucket's padded query / key length, Hq / Hkv heads, D / Dv head dims.
"""

from __future__ import annotations

import functools
import math
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .._stock import stock_sdpa
from ..balance import interval_ranges, rows_outside
from .explicit import TwoTailedSigmoid, explicit_attention, graph_zero, own_key_attention

__all__ = ["VarlenMeta", "flash_unusable_reason", "fused_unusable_reason", "plan_varlen", "size_class", "varlen_attention"]

EXACT_ABOVE = 1024  # pieces longer than this run at their exact length
EXACT_UP_TO = 16  # ... and so do pieces this short (see size_class)
BAND_MIN = EXACT_UP_TO  # a windowed piece with at most this many keys runs as one masked block, not bands
FULL, CAUSAL, MASKED = 0, 1, 2  # block kinds of the maskless plan
PRIMARY, SECONDARY = 0, 1  # every real query row has one primary block, and at most one secondary
# Soft-capped attention on the inputs the fused op takes (which has no soft-cap): "blocks" runs the maskless
# blocks with explicit scores, "masked" the masked plan with explicit scores. Measured (bench section
# "variants"): the same speed without a window, blocks 5-9x faster with one (its bands skip masked-out keys).
SOFTCAP_PLAN = "blocks"
_fused_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_fused_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def size_class(n: Tensor) -> Tensor:
    """Round lengths up to a size class: multiples of 16 up to 128, then 1/8 of the enclosing power of two,
    exact above ``EXACT_ABOVE``. Padding wastes at most ~1/8 of a piece's length.

    Lengths up to ``EXACT_UP_TO`` stay exact. Fused SDPA kernels pick their arithmetic per vector lane: torch's
    CPU kernel computes ``exp`` with a vectorized approximation on whole lanes (8 or 16 floats) and with libm
    on a row's remainder. A piece shorter than a lane is all remainder at its own length; padded to 16 it
    would be all approximation, with up to ~10x the float32 gradient error on peaked softmax. Above 16 a
    piece fills lanes at its own length too, and padding leaves its worst error unchanged.

    >>> size_class(torch.tensor([1, 16, 17, 130, 600, 1000, 1500]))
    tensor([   1,   16,   32,  144,  640, 1024, 1500])
    """
    n = n.to(torch.int64)
    step = (2 ** torch.floor(torch.log2(n.clamp_min(1).double())).to(torch.int64) // 8).clamp_min(16)
    rounded = (n + step - 1) // step * step
    return torch.where((n > EXACT_ABOVE) | (n <= EXACT_UP_TO), n, rounded)


@dataclass(frozen=True, eq=False)
class Bucket:
    q_index: Tensor  # int64 [n, Lq] rows of q_tok
    k_index: Tensor  # int64 [n, Lk] rows of the key buffer
    mask: Tensor | None  # bool [n, 1, Lq, Lk] (masked plan, and narrow windows); None: see ``causal``
    causal: bool = True  # without a mask: top-left causal (True) or unmasked (False)
    secondary: bool = False  # maskless plan: a prefix or band block, merged into its rows' primary block
    merged: bool = False  # maskless plan: some real row of this bucket has a slot in another bucket too
    padded: bool = True  # maskless plan: some slot of this bucket is a padded slot
    q_start: int = -1  # maskless plan: with n == 1, the first row when q_index is one range of rows, else -1
    k_start: int = -1  # likewise for k_index

    def to(self, device: torch.device) -> Bucket:
        mask = None if self.mask is None else self.mask.to(device)
        return Bucket(self.q_index.to(device), self.k_index.to(device), mask, self.causal, self.secondary, self.merged,
                      self.padded, self.q_start, self.k_start)


@dataclass(frozen=True, eq=False)
class BucketPlan:
    """Buckets with one gather for all their queries, one for all their keys, and each slot's output row."""

    buckets: tuple[Bucket, ...]
    q_gather: Tensor  # int64: every bucket's q_index, flattened and concatenated
    k_gather: Tensor  # int64: likewise for k_index
    # int64: for every bucket slot (same order), its query row; a padded slot gets a spare row >= Tq (masked
    # plan: all share row Tq; maskless plan: one private row each, so a row never takes two padded slots)
    out_rows: Tensor
    num_rows: int  # rows of the output buffer: Tq and the spare rows
    q_rest: Tensor  # int64: q_index of the buckets that are not one range (q_start < 0), concatenated
    k_rest: Tensor  # likewise for keys

    @classmethod
    def of(cls, buckets: list[Bucket], slot_rows: list[Tensor], num_rows: int) -> BucketPlan:
        empty = torch.zeros(0, dtype=torch.int64)
        cat = lambda ts: torch.cat(ts) if ts else empty  # noqa: E731
        return cls(tuple(buckets), cat([b.q_index.flatten() for b in buckets]),
                   cat([b.k_index.flatten() for b in buckets]), cat(slot_rows), num_rows,
                   cat([b.q_index.flatten() for b in buckets if b.q_start < 0]),
                   cat([b.k_index.flatten() for b in buckets if b.k_start < 0]))

    def to(self, device: torch.device) -> BucketPlan:
        return BucketPlan(tuple(b.to(device) for b in self.buckets), self.q_gather.to(device),
                          self.k_gather.to(device), self.out_rows.to(device), self.num_rows,
                          self.q_rest.to(device), self.k_rest.to(device))


@dataclass(frozen=True, eq=False)
class VarlenMeta:
    """A rank's pieces (``O(pieces)``, on the host) and the token-level gathers each path builds from them on
    first use, for this rank only: :attr:`blocks` (the maskless plan), :meth:`masked`, :meth:`flash_meta`,
    :meth:`self_keys`. A path never taken costs nothing (flash-attn on CUDA never builds the maskless plan)."""

    piece_q: Tensor  # int64 [P, 2] (first local query row, length), on the host
    piece_k: Tensor  # int64 [P, 2] (first key flat id, length), on the host
    piece_flat: Tensor  # int64 [P] flat id of each piece's first query, on the host
    piece_doc_start: Tensor  # int64 [P] its document's start position, on the host
    key_lut: Tensor = field(repr=False)  # int64 [B * Sp] key-buffer row of each flat id (-1 = absent), host, or a FlatIndex
    num_queries: int = 0
    padded_len: int = 1
    window_left: int = -1
    # int64 [B * Sp] (host): bidirectional block of each flat id (0 = none), or None; with blocks the pieces of this
    # meta run the masked plan, whose masks let a query see the later keys of its block (blockdiag_dist.bidirectional)
    labels: Tensor | None = field(default=None, repr=False)
    # with labels: the pieces none of whose queries lies in a block, planned without labels (every path open to
    # them), or None when every piece holds a block; this meta then holds only the pieces with blocks
    plain: VarlenMeta | None = field(default=None, repr=False)
    # with labels: a query sees every key of its block, the earlier ones beyond the window too (whole blocks)
    whole_blocks: bool = False
    band_min: int = BAND_MIN  # see plan_varlen
    device: torch.device = field(default=torch.device("cpu"), repr=False)  # where the built plans live
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def blocks(self) -> BucketPlan:
        """The maskless plan (blocks merged by log-sum-exp; a query row may have two slots), built on first use
        (``O(this rank's query and key slots)``) on :attr:`device`."""
        cached = self._cache.get("blocks")
        if cached is None:
            cached = self._cache.setdefault("blocks", _maskless_plan(self).to(self.device))
        return cached

    @property
    def pad_rows(self) -> Tensor:
        """int64, ascending: the local rows outside this meta's pieces (padding queries: their outputs are 0),
        built on first use on :attr:`device` from the gaps between the pieces (``O(those rows)``)."""
        cached = self._cache.get("pad_rows")
        if cached is None:
            rows = rows_outside(*self.piece_q.unbind(1), self.num_queries, self.device)
            cached = self._cache.setdefault("pad_rows", rows)
        return cached

    def with_blocks(self, blocks: BucketPlan) -> VarlenMeta:
        """This meta with another maskless plan (tests of the kernel's paths)."""
        return dataclasses.replace(self, _cache={"blocks": blocks})

    def to(self, device: torch.device) -> VarlenMeta:
        built = {k: self._cache[k].to(device) for k in ("blocks", "pad_rows") if k in self._cache}
        return VarlenMeta(
            piece_q=self.piece_q,
            piece_k=self.piece_k,
            piece_flat=self.piece_flat,
            piece_doc_start=self.piece_doc_start,
            key_lut=self.key_lut,
            num_queries=self.num_queries,
            padded_len=self.padded_len,
            window_left=self.window_left,
            labels=self.labels,
            plain=None if self.plain is None else self.plain.to(device),
            whole_blocks=self.whole_blocks,
            band_min=self.band_min,
            device=torch.device(device),
            _cache=built,
        )

    def masked(self, device: torch.device) -> BucketPlan:
        """The plan with masks (one bucket slot per query row), for what the fused op cannot run; built once
        per device, on first use."""
        key = ("masked", device)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache.setdefault(key, _masked_plan(self).to(device))
        return cached

    @property
    def sees_only_itself(self) -> bool:
        """Each query sees only its own key: a window of 0, or pieces of one query and one key each (chunks of one
        position, documents of one token), whose only key is the query's own token."""
        cached = self._cache.get("self_only")
        if cached is None:
            single = (self.piece_q[:, 1] == 1) & (self.piece_k[:, 1] == 1)
            cached = self._cache.setdefault("self_only", self.window_left == 0 or bool(single.all()))
        return cached

    def self_keys(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(local rows of the real queries, key-buffer row of each one's own token), built once per device."""
        cached = self._cache.get(("self", device))
        if cached is None:
            rows = interval_ranges(self.piece_q[:, 0], self.piece_q[:, 1])
            keys = self.key_lut[interval_ranges(self.piece_flat, self.piece_q[:, 1])]
            cached = self._cache.setdefault(("self", device), (rows.to(device), keys.to(device)))
        return cached

    def flash_meta(self, device: torch.device) -> dict:
        """cu_seqlens-style metadata for flash-attn's varlen function, built once per device."""
        cached = self._cache.get(("flash", device))
        if cached is None:
            lens_q, lens_k = self.piece_q[:, 1], self.piece_k[:, 1]
            q_rows = interval_ranges(self.piece_q[:, 0], lens_q)
            k_rows = self.key_lut[interval_ranges(self.piece_k[:, 0], lens_k)]
            out_index = torch.full((self.num_queries,), q_rows.numel(), dtype=torch.int64)
            out_index[q_rows] = torch.arange(q_rows.numel())
            cu_q = torch.nn.functional.pad(torch.cumsum(lens_q, 0), (1, 0)).to(torch.int32)
            cu_k = torch.nn.functional.pad(torch.cumsum(lens_k, 0), (1, 0)).to(torch.int32)
            tensors = {"q_rows": q_rows, "k_rows": k_rows, "out_index": out_index, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
            cached = {k: v.to(device) for k, v in tensors.items()}
            cached["max_seqlen_q"] = int(lens_q.max()) if lens_q.numel() else 0
            cached["max_seqlen_k"] = int(lens_k.max()) if lens_k.numel() else 0
            cached = self._cache.setdefault(("flash", device), cached)
        return cached


def _rows_of(key_lut, flat: Tensor) -> Tensor:
    """``key_lut[flat]`` for ``flat [n, m]``; by block rather than by key for a
    :class:`~blockdiag_dist.shard_plan.FlatIndex` (:meth:`~blockdiag_dist.shard_plan.FlatIndex.rows_of`)."""
    return key_lut.rows_of(flat) if hasattr(key_lut, "rows_of") else key_lut[flat]


def _rows_in_blocks(key_lut, flat: Tensor, lengths: Tensor) -> Tensor:
    """``key_lut[flat]`` for ``flat`` the concatenation of blocks of ``lengths`` ids; by block rather than by key
    for a :class:`~blockdiag_dist.shard_plan.FlatIndex` (:meth:`~blockdiag_dist.shard_plan.FlatIndex.rows_in_blocks`)."""
    return key_lut.rows_in_blocks(flat, lengths) if hasattr(key_lut, "rows_in_blocks") else key_lut[flat]


def plan_varlen(
    q_flat: Tensor, k_flat: Tensor, segments: Tensor, doc_starts: Tensor, padded_len: int, window_left: int,
    *, band_min: int = BAND_MIN,
) -> VarlenMeta:
    """Pieces and maskless blocks for local queries (flat ids ``[Tq]``) against a key buffer (flat ids ``[Tk]``);
    a piece that a window cuts and that has at most ``band_min`` keys gets one masked block instead of bands.
    Pieces found from per-token ``segments`` / ``doc_starts`` (``[B * Sp]``); a step's planning gives its
    rank's pieces directly (:func:`plan_varlen_pieces`)."""
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
    key_lut = torch.full((segments.numel(),), -1, dtype=torch.int64)
    key_lut[k_flat] = torch.arange(k_flat.numel())
    pieces = torch.stack([p_start, p_len, p_flat0, doc_starts[p_flat0]], 1)
    return plan_varlen_pieces(pieces, q_flat.numel(), key_lut, padded_len, window_left, band_min=band_min)


def plan_varlen_pieces(
    pieces: Tensor, num_queries: int, key_lut, padded_len: int, window_left: int, *, band_min: int = BAND_MIN,
    key_end: Tensor | None = None, labels: Tensor | None = None, block_start: Tensor | None = None,
) -> VarlenMeta:
    """:func:`plan_varlen` from the rank's pieces, int64 ``[P, 4]`` rows ``(first local query row, length, flat id
    of the first query, its document's start position)`` in local order, and ``key_lut``: the key-buffer row of
    flat ids (a ``[B * Sp]`` tensor, -1 = absent, or any object indexed the same way, e.g.
    :class:`blockdiag_dist.shard_plan.FlatIndex`). Bidirectional blocks: ``key_end`` int64 ``[P]`` (one past the
    last key of each piece, global position) and ``labels`` int64 ``[B * Sp]`` (the block of each flat id):
    only the pieces one of whose queries lies in a block run masked by label; the others are planned as without
    blocks (``VarlenMeta.plain``), and without any such piece the meta has no labels at all. Whole blocks (a query
    sees its whole block beyond the window): ``block_start`` int64 ``[P]``, the first token of the block each
    piece's queries reach furthest back into (the piece's keys then start at it when the window starts later)."""
    Tq = num_queries
    if labels is not None:
        p_len = pieces[:, 1]
        q_lab = labels[interval_ranges(pieces[:, 2], p_len)]
        piece_of = torch.repeat_interleave(torch.arange(p_len.numel()), p_len)
        blocked = torch.zeros(p_len.numel(), dtype=torch.int64).scatter_reduce_(0, piece_of, (q_lab != 0).long(), "amax")
        blocked = blocked.bool() | (key_end > pieces[:, 2] % padded_len + p_len)
        if not bool(blocked.any()):  # no query of this rank in a block: exactly the plan without blocks
            return plan_varlen_pieces(pieces, Tq, key_lut, padded_len, window_left, band_min=band_min)
        if not bool(blocked.all()):
            plain = plan_varlen_pieces(pieces[~blocked], Tq, key_lut, padded_len, window_left, band_min=band_min)
            meta = plan_varlen_pieces(pieces[blocked], Tq, key_lut, padded_len, window_left, band_min=band_min,
                                      key_end=key_end[blocked], labels=labels,
                                      block_start=None if block_start is None else block_start[blocked])
            return dataclasses.replace(meta, plain=plain, _cache={})
    p_start, p_len, p_flat0, p_dstart = pieces.unbind(1)
    p_qfirst = p_flat0 % padded_len
    p_kfirst = _window_start(p_dstart, p_qfirst, window_left)
    # whole blocks: the keys start where the window or the furthest block does (the masked plan masks the rest)
    k_first = p_kfirst if block_start is None or labels is None else torch.minimum(p_kfirst, block_start)
    p_klen = (p_qfirst + p_len if key_end is None else key_end) - k_first
    return VarlenMeta(
        piece_q=torch.stack([p_start, p_len], 1),
        piece_k=torch.stack([p_flat0 - p_qfirst + k_first, p_klen], 1),
        piece_flat=p_flat0,
        piece_doc_start=p_dstart,
        key_lut=key_lut,
        num_queries=Tq,
        padded_len=padded_len,
        window_left=window_left,
        labels=labels,
        whole_blocks=block_start is not None and labels is not None,
        band_min=band_min,
    )


def _window_start(doc_start: Tensor, first: Tensor, left: int) -> Tensor:
    """The first key a piece's first query ``first`` sees: its document's start, or ``left`` positions back."""
    return doc_start if left < 0 else torch.maximum(doc_start, first - left)


def _maskless_plan(meta: VarlenMeta) -> BucketPlan:
    """The maskless blocks of the pieces of ``meta`` (see :func:`_block_plan`), checked to give every real query
    row a block and no padding row one."""
    p_start, p_len = meta.piece_q.unbind(1)
    p_flat0, p_dstart, left, Tq = meta.piece_flat, meta.piece_doc_start, meta.window_left, meta.num_queries
    p_qfirst = p_flat0 % meta.padded_len
    p_kfirst = _window_start(p_dstart, p_qfirst, left)
    blocks = _block_plan(p_start, p_len, p_flat0, p_qfirst, p_dstart, p_kfirst, meta.key_lut, Tq, left, meta.band_min)
    real = torch.zeros(Tq, dtype=torch.bool)
    real[interval_ranges(p_start, p_len)] = True
    covered = torch.zeros(Tq, dtype=torch.bool)
    covered[blocks.out_rows[blocks.out_rows < Tq]] = True
    assert bool((covered == real).all()), "varlen plan: a real query row has no block, or a padding row has one"
    return blocks


def _block_plan(p_start, p_len, p_flat0, p_qfirst, p_dstart, p_kfirst, key_lut, Tq: int, left: int, band_min: int) -> BucketPlan:
    """The maskless blocks of every piece, bucketed by (kind, Lq, Lk).

    A block is described by where its slots point: query slot ``a`` is position ``q0 + qdir * a`` (real iff in
    ``[qlo, qhi]``, otherwise it repeats the nearest real query and its output is dropped) and key slot ``c``
    is position ``k0 + kdir * c`` clamped to ``[klo, khi]``. Positions are in the piece's document row.
    """
    p_last = p_qfirst + p_len - 1
    binds = (p_last - p_dstart > left) if left >= 0 else torch.zeros_like(p_len, dtype=torch.bool)
    whole = (~binds).nonzero().flatten()
    parts: list[dict[str, Tensor]] = []
    if left >= 0:  # pieces with a short key span: one masked block at exact size (as stock SDPA runs them)
        mk = (binds & (p_last - p_kfirst + 1 <= band_min)).nonzero().flatten()
        qf, ql, kf = p_qfirst[mk], p_last[mk], p_kfirst[mk]
        parts.append(dict(piece=mk, q0=qf, qdir=1, k0=kf, kdir=1, klo=kf, khi=ql, qlo=qf, qhi=ql, kind=MASKED,
                          lq=size_class(p_len[mk]), lk=size_class(ql - kf + 1), role=PRIMARY))
        binds[mk] = False
    # square blocks of pieces the window does not cut
    qf, ql = p_qfirst[whole], p_last[whole]
    cls = size_class(p_len[whole])
    parts.append(dict(piece=whole, q0=qf, qdir=1, k0=qf, kdir=1, klo=qf, khi=ql, qlo=qf, qhi=ql, kind=CAUSAL, lq=cls, lk=cls,
                      role=PRIMARY))
    # unmasked prefix blocks (keys before the first query), at the prefix's exact length
    pre = whole[p_kfirst[whole] < p_qfirst[whole]]
    qf, ql, kf = p_qfirst[pre], p_last[pre], p_kfirst[pre]
    parts.append(dict(piece=pre, q0=qf, qdir=1, k0=kf, kdir=1, klo=kf, khi=qf - 1, qlo=qf, qhi=ql, kind=FULL,
                      lq=size_class(p_len[pre]), lk=qf - kf, role=SECONDARY))
    if bool(binds.any()):
        # chunks of c = max(left, 1) positions aligned to the document start
        cut = binds.nonzero().flatten()
        c = max(left, 1)
        k_lo = (p_qfirst[cut] - p_dstart[cut]) // c
        n_chunks = (p_last[cut] - p_dstart[cut]) // c - k_lo + 1
        piece = torch.repeat_interleave(cut, n_chunks)
        k = torch.repeat_interleave(k_lo, n_chunks) + interval_ranges(torch.zeros_like(n_chunks), n_chunks)
        s = p_dstart[piece] + k * c
        qlo, qhi = torch.maximum(s, p_qfirst[piece]), torch.minimum(s + c - 1, p_last[piece])
        cls = size_class(torch.full_like(s, c))
        parts.append(dict(piece=piece, q0=s, qdir=1, k0=s, kdir=1, klo=s, khi=qhi, qlo=qlo, qhi=qhi, kind=CAUSAL, lq=cls, lk=cls,
                          role=PRIMARY))
        if left >= 1:  # the band on the left positions before each chunk, in reverse order (none for chunk 0)
            band = k > 0
            piece, s, qlo, qhi, cls = piece[band], s[band], qlo[band], qhi[band], cls[band]
            parts.append(dict(piece=piece, q0=s + c - 1, qdir=-1, k0=s - 1, kdir=-1, klo=s - left, khi=s - 1,
                              qlo=qlo, qhi=qhi, kind=CAUSAL, lq=cls, lk=cls, role=SECONDARY))
    return _bucket(parts, p_start - p_qfirst, p_flat0 - p_qfirst, key_lut, Tq, left)


def _ragged(n: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(k)`` for each ``k`` of ``n``."""
    ends = np.cumsum(n)
    return np.arange(int(ends[-1]) if n.size else 0, dtype=np.int64) - np.repeat(ends - n, n)


def _is_range(x: np.ndarray) -> bool:
    """Whether ``x`` is ``[s, s + 1, ..., s + len - 1]``."""
    return x.size == 0 or (int(x[-1]) - int(x[0]) == x.size - 1 and bool((np.diff(x) == 1).all()))


_SLAB = 1 << 18  # key slots handled at once: a few arrays of this many int64 stay in the CPU's cache


def _slabs(lk: np.ndarray, plain: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive ranges of blocks ``[a, b)`` of at most ``_SLAB`` key slots each (or one block, when larger), all
    ``plain`` or none."""
    ends = np.cumsum(lk)
    change = np.flatnonzero(plain[1:] != plain[:-1]) + 1  # a slab never crosses these
    out, a = [], 0
    while a < lk.size:
        done = int(ends[a - 1]) if a else 0
        b = max(int(np.searchsorted(ends, done + _SLAB, side="right")), a + 1)
        nxt = change[np.searchsorted(change, a, side="right"):][:1]
        if nxt.size:
            b = min(b, int(nxt[0]))
        out.append((a, b))
        a = b
    return out


def _key_rows(blk: dict, base: np.ndarray, lk: np.ndarray, a: int, b: int, key_lut, plain: bool) -> np.ndarray:
    """The key-buffer rows of the key slots of blocks ``[a, b)``: slot ``c`` is position ``k0 + kdir * c`` clamped
    to ``[klo, khi]`` of its piece's row (``plain``: every block's slots are ``[klo, khi]`` in order, one range of
    flat ids each); a key outside the needed set can only sit where no real query looks, so any present key will
    do (the block's first real query's own)."""
    n = lk[a:b]
    if plain:
        k = torch.from_numpy(key_lut.rows_of_ranges(base[a:b] + blk["klo"][a:b], n))
    else:
        kb, c = np.repeat(np.arange(a, b), n), _ragged(n)
        kflat = base[kb] + np.minimum(np.maximum(blk["k0"][kb] + blk["kdir"][kb] * c, blk["klo"][kb]), blk["khi"][kb])
        k = _rows_in_blocks(key_lut, torch.from_numpy(kflat), torch.from_numpy(n))
    missing = (k < 0).nonzero().flatten()
    if missing.numel():
        kb = torch.repeat_interleave(torch.arange(a, b), torch.from_numpy(n))
        k[missing] = key_lut[torch.from_numpy(base + blk["qlo"])[kb[missing]]]
    assert bool((k >= 0).all()), "varlen plan: a piece's key is missing from the key buffer"
    return k.numpy()


def _bucket(parts: list[dict], p_row0: Tensor, p_base: Tensor, key_lut, Tq: int, left: int) -> BucketPlan:
    """Group blocks by (role, kind, Lq, Lk), primary buckets first, and build each bucket's gather indices,
    output rows and (kind MASKED only) mask. ``p_row0``: local row a piece's position 0 would have;
    ``p_base``: flat id of its row's position 0.

    Every block's slots at once, in numpy over the blocks (each bucket a slice of one index per slot): the cost
    is a few dozen calls whatever the number of buckets."""
    cols = ("piece", "q0", "qdir", "k0", "kdir", "klo", "khi", "qlo", "qhi", "kind", "lq", "lk", "role")
    blk = {name: np.concatenate([p[name].numpy() if isinstance(p[name], Tensor) else np.full(p["piece"].numel(), p[name], np.int64)
                                 for p in parts]).astype(np.int64, copy=False) for name in cols}
    group_key = (blk["role"] << 62) | (blk["kind"] << 60) | (blk["lq"] << 30) | blk["lk"]  # sizes < 2**30
    order = np.argsort(group_key, kind="stable")  # by bucket, primary first; each bucket's blocks in their order
    blk = {name: v[order] for name, v in blk.items()}
    group_key = group_key[order]
    nb = group_key.size
    first = np.flatnonzero(np.concatenate([[True], group_key[1:] != group_key[:-1]])) if nb else np.zeros(0, np.int64)
    bounds = np.append(first, nb)  # bucket g holds blocks [bounds[g], bounds[g + 1])
    lq, lk = blk["lq"], blk["lk"]
    row0, base = p_row0.numpy()[blk["piece"]], p_base.numpy()[blk["piece"]]
    # query slots: slot a of a block is position q0 + qdir * a, real iff in [qlo, qhi] (else it repeats the nearest)
    qb, a = np.repeat(np.arange(nb), lq), _ragged(lq)
    qpos = blk["q0"][qb] + blk["qdir"][qb] * a
    qlo, qhi = blk["qlo"][qb], blk["qhi"][qb]
    valid = (qpos >= qlo) & (qpos <= qhi)
    q_index = row0[qb] + np.minimum(np.maximum(qpos, qlo), qhi)
    # key slots: slot c is position k0 + kdir * c clamped to [klo, khi]
    # a block whose slots are its positions in order, unclamped, is one range of flat ids
    plain = (blk["kdir"] == 1) & (blk["k0"] == blk["klo"]) & (blk["khi"] - blk["klo"] + 1 == lk)
    if not hasattr(key_lut, "rows_of_ranges"):
        plain[:] = False
    slabs = [_key_rows(blk, base, lk, a, b, key_lut, bool(plain[a])) for a, b in _slabs(lk, plain)]
    k_np = slabs[0] if len(slabs) == 1 else np.concatenate(slabs) if slabs else np.zeros(0, np.int64)
    k_index = torch.from_numpy(k_np)
    # every padded slot gets a spare row of its own (>= Tq); a real row with two slots is merged
    rows = np.where(valid, q_index, -1)
    padded = ~valid
    n_pad = int(padded.sum())
    rows[padded] = Tq + np.arange(n_pad)
    shared = np.bincount(rows[valid], minlength=Tq) > 1
    slot_shared = np.zeros(rows.size, dtype=np.int64)
    slot_shared[valid] = shared[rows[valid]]
    # per bucket: slots [qs[g], qs[g + 1]) and [ks[g], ks[g + 1]); every bucket has a block and every block a slot
    q_end, k_end = np.cumsum(lq), np.cumsum(lk)
    qs = np.append(0, q_end)[bounds]
    ks = np.append(0, k_end)[bounds]
    nbk = bounds.size - 1
    if nbk:
        any_shared = np.add.reduceat(slot_shared, qs[:-1]) > 0
        any_padded = np.add.reduceat(padded.astype(np.int64), qs[:-1]) > 0
    one = ((bounds[1:] - bounds[:-1]) == 1).tolist()
    q_t, rows_t = torch.from_numpy(q_index), torch.from_numpy(rows)
    buckets: list[Bucket] = []
    q_keep, k_keep = np.zeros(q_index.size, dtype=bool), np.zeros(k_np.size, dtype=bool)
    qsl, ksl, bl = qs.tolist(), ks.tolist(), bounds.tolist()
    for g, key in enumerate(group_key[first].tolist()):
        role, kind, lqg, lkg = key >> 62, (key >> 60) & 3, (key >> 30) & (2**30 - 1), key & (2**30 - 1)
        n, q0, q1, k0, k1 = bl[g + 1] - bl[g], qsl[g], qsl[g + 1], ksl[g], ksl[g + 1]
        # one range of rows: a bucket of one block whose slots step by one
        q_start = int(q_index[q0]) if one[g] and _is_range(q_index[q0:q1]) else -1
        k_start = int(k_np[k0]) if one[g] and _is_range(k_np[k0:k1]) else -1
        if q_start < 0:
            q_keep[q0:q1] = True
        if k_start < 0:
            k_keep[k0:k1] = True
        mask = None
        if kind == MASKED:  # bottom-right causal within the window; padded query slots see one real key
            qp = torch.from_numpy(qpos[q0:q1]).view(n, lqg, 1)
            val = torch.from_numpy(valid[q0:q1]).view(n, lqg, 1)
            b0 = bl[g]
            kp = torch.from_numpy(blk["k0"][b0:b0 + n, None] + blk["kdir"][b0:b0 + n, None] * np.arange(lkg)).view(n, 1, lkg)
            khi = torch.from_numpy(blk["khi"][bl[g]:bl[g + 1]]).view(n, 1, 1)
            m = val & (kp <= khi) & (kp <= qp) & (kp >= qp - left)
            mask = (m | (~val & (torch.arange(lkg) == 0)))[:, None]
        buckets.append(Bucket(q_index=q_t[q0:q1].view(n, lqg), k_index=k_index[k0:k1].view(n, lkg),
                              mask=mask, causal=kind == CAUSAL, secondary=role == SECONDARY,
                              merged=role == SECONDARY or bool(any_shared[g]), padded=bool(any_padded[g]),
                              q_start=q_start, k_start=k_start))
    return BucketPlan(tuple(buckets), q_t, k_index, rows_t, Tq + n_pad, q_t[torch.from_numpy(q_keep)],
                      k_index[torch.from_numpy(k_keep)])


def _masked_plan(meta: VarlenMeta) -> BucketPlan:
    """One bucket slot per query row: square pieces run causal, every other piece with an explicit
    bottom-right-aligned causal (and window) mask, in buckets by (query size class, key size class)."""
    sp, left, Tq = meta.padded_len, meta.window_left, meta.num_queries
    p_start, p_len = meta.piece_q.unbind(1)
    p_kflat0, p_klen = meta.piece_k.unbind(1)
    p_qfirst, p_kfirst = meta.piece_flat % sp, p_kflat0 % sp
    masked = (p_klen != p_len) | ((left >= 0) & (left < p_len - 1)) | (meta.labels is not None)
    cq, ck = size_class(p_len), size_class(p_klen)
    ck = torch.where(masked, ck, cq)
    keys, group_of = torch.unique((masked.long() << 62) | (cq << 31) | ck, return_inverse=True)
    buckets: list[Bucket] = []
    slot_rows: list[Tensor] = []
    for g, key in enumerate(keys.tolist()):
        is_masked, lq, lk = key >> 62, (key >> 31) & (2**31 - 1), key & (2**31 - 1)
        idx = (group_of == g).nonzero().flatten()
        a = torch.arange(lq)[None, :]
        c = torch.arange(lk)[None, :]
        qlen, klen = p_len[idx, None], p_klen[idx, None]
        q_index = p_start[idx, None] + torch.minimum(a, qlen - 1)
        k_index = _rows_of(meta.key_lut, p_kflat0[idx, None] + torch.minimum(c, klen - 1))
        if meta.labels is not None:  # text between a block's runs after the piece is not fetched (-1): masked below
            k_index = k_index.clamp(min=0)
        mask = None
        if is_masked:
            qpos = (p_qfirst[idx, None] + a)[:, :, None]
            kpos = (p_kfirst[idx, None] + c)[:, None, :]
            valid_q = (a < qlen)[:, :, None]
            m = valid_q & (c < klen)[:, None, :] & (kpos <= qpos)
            if left >= 0:
                m &= kpos >= qpos - left
            if meta.labels is not None:  # the later keys of the query's block (whole blocks: every key of it)
                base = (p_kflat0[idx] - p_kfirst[idx])[:, None]
                lab_q = meta.labels[base + (p_qfirst[idx, None] + torch.minimum(a, qlen - 1))][:, :, None]
                lab_k = meta.labels[base + (p_kfirst[idx, None] + torch.minimum(c, klen - 1))][:, None, :]
                same = valid_q & (c < klen)[:, None, :] & (lab_q == lab_k) & (lab_q != 0)
                m |= same if meta.whole_blocks else same & (kpos > qpos)
            m |= ~valid_q & (c == 0)[:, None, :]  # padded query slots see one real key: finite, then dropped
            mask = m[:, None]
        buckets.append(Bucket(q_index=q_index, k_index=k_index, mask=mask))
        slot_rows.append(torch.where(a < qlen, q_index, Tq).flatten())
    return BucketPlan.of(buckets, slot_rows, Tq + 1)


@functools.lru_cache(maxsize=1)
def _flash_varlen_fn():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return flash_attn_varlen_func


FLASH_DEVICE_TYPES = ("cuda",)  # where flash-attn's kernels run (an emulation may add "cpu": verify.gpu.emulate)
FLASH_MAX_HEAD_DIM = 256  # flash-attn 2: forward and backward, after rounding the head dim up to a multiple of 8
FLASH_MIN_CAPABILITY = (8, 0)  # flash-attn 2: Ampere or newer


def _device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device (None elsewhere)."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def flash_unusable_reason(q_tok: Tensor, dim: int, dim_v: int, *, dropout_p: float = 0.0, softcap: float | None = None,
                          sequences: int | None = None) -> str | None:
    """Why flash-attn's varlen function cannot run these tensors (None when it can): every precondition that
    flash-attn 2 checks itself (``flash_api.cpp``) and would raise on, checked here so that the call falls back
    instead. ``sequences``: pieces of this rank (0 = padding only; flash-attn refuses an empty batch)."""
    device = q_tok.device
    if device.type not in FLASH_DEVICE_TYPES:
        return f"device is {device.type}, flash-attn needs cuda"
    if q_tok.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype is {q_tok.dtype}, flash-attn needs float16 or bfloat16"
    if dim != dim_v:
        return f"D={dim} != Dv={dim_v}, flash-attn needs equal head dims"
    padded = -(-dim // 8) * 8  # flash-attn's python wrapper pads the head dim to a multiple of 8
    if padded > FLASH_MAX_HEAD_DIM:
        return f"head dim D={dim} (padded to {padded}) > {FLASH_MAX_HEAD_DIM}, the most flash-attn supports"
    cap = _device_capability(device)
    if cap is not None and tuple(cap) < FLASH_MIN_CAPABILITY:
        return (f"compute capability sm{cap[0]}{cap[1]} < sm{FLASH_MIN_CAPABILITY[0]}{FLASH_MIN_CAPABILITY[1]}, "
                "flash-attn needs an Ampere GPU or newer")
    if softcap is not None and softcap > 0 and dropout_p > 0:
        return f"softcap={softcap} with dropout_p={dropout_p}: flash-attn has no dropout with a soft-cap"
    if sequences is not None and sequences < 1:
        return "no sequence on this rank (padding only): flash-attn needs at least one"
    if _flash_varlen_fn() is None:
        return "flash_attn is not importable"
    return None


def fused_unusable_reason(q_tok: Tensor, dim: int, dim_v: int, dropout_p: float) -> str | None:
    """Why the maskless blocks (torch's fused CPU attention) cannot run these tensors (None when they can)."""
    if q_tok.device.type != "cpu":
        return f"device is {q_tok.device.type}, the fused op with logsumexp is used on cpu"
    if dim != dim_v:
        return f"D={dim} != Dv={dim_v}"
    if dropout_p > 0:
        return f"dropout_p={dropout_p}: the fused CPU op has no dropout"
    return None


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A bool mask as the fused op takes it: 0 where allowed, -inf elsewhere, in the query's dtype."""
    return None if mask is None else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)


class _MergedBlocks(torch.autograd.Function):
    """``q_tok [Tq, Hq, D]``, ``kv_buf [Tk, Hkv * 2D]`` -> ``[Tq, Hq, D]``: every bucket through the fused op,
    into a buffer whose rows after ``Tq`` are the padded slots' spare rows (one each, dropped).

    Primary buckets (every real row in exactly one) are copied into place; each secondary bucket is then
    merged into its rows by log-sum-exp. Backward: each bucket's fused backward with its rows' merged output
    and logsumexp; a bucket none of whose rows was merged reuses its own forward output and logsumexp, and a
    padded slot keeps its own (so its probabilities stay <= 1 and its zero gradient stays finite).

    Sinks ``[Hq]`` (optional) are one more block of every real row, with logsumexp ``sinks[h]`` and output 0:
    merged last, they scale each row by ``exp(lse - lse') = sigmoid(lse - sink)`` with ``lse' = logaddexp(lse,
    sink)`` (the sigmoid keeps a factor near 1 precise: ``exp`` of a difference of two large logsumexps loses
    it). The blocks' backward with the merged output and ``lse'`` is then exact, and the sinks' own gradient is
    ``-sum_rows exp(sink - lse') * (dout . out)``. For half inputs with sinks the backward's row term
    ``dout . out`` is taken from the float32 merged output (:func:`_fused_bwd_exact_delta`), never from the
    output rounded after the sink's scaling.
    """

    @staticmethod
    def forward(ctx, q_tok: Tensor, kv_buf: Tensor, pad_rows: Tensor, plan: BucketPlan, heads_kv: int, scale: float | None,
                sinks: Tensor | None = None):
        Hq, D = q_tok.shape[1], q_tok.shape[2]
        qshape = [tuple(b.q_index.shape) for b in plan.buckets]
        kshape = [tuple(b.k_index.shape) for b in plan.buckets]
        q_rows = q_tok.reshape(q_tok.shape[0], Hq * D)
        g_q, g_kv = q_rows.index_select(0, plan.q_rest), kv_buf.index_select(0, plan.k_rest)
        qs = _operands(q_rows, g_q, [b.q_start for b in plan.buckets], qshape, [(Hq, D)])
        kvs = _operands(kv_buf, g_kv, [b.k_start for b in plan.buckets], kshape, [(heads_kv, D), (heads_kv, D)])
        outs, lses = [], []
        for b, q, k, v in zip(plan.buckets, qs, kvs[0::2], kvs[1::2]):
            o, lse = _fused_fwd(q, k, v, 0.0, b.causal, attn_mask=_additive(b.mask, q.dtype), scale=scale)
            outs.append(o)
            lses.append(lse)
        acc = lses[0].dtype  # merged in logsumexp's precision (float32 for half inputs)
        out = q_tok.new_empty((plan.num_rows, Hq, D), dtype=acc)
        lse_rows = q_tok.new_empty((plan.num_rows, Hq), dtype=acc)
        out.index_fill_(0, pad_rows, 0.0)
        Tq = q_tok.shape[0]
        out[Tq:], lse_rows[Tq:] = 0.0, -torch.inf  # a secondary bucket's padded slot merges with nothing
        rows_of = _split(plan.out_rows, qshape)
        merged = [b.merged or sinks is not None for b in plan.buckets]  # sinks: every row is merged with its sink
        for b, o, lse, rows, m in zip(plan.buckets, outs, lses, rows_of, merged):
            o_t, l_t = o.transpose(1, 2).reshape(-1, Hq, D).to(acc), lse.transpose(1, 2).reshape(-1, Hq)
            if b.secondary:  # its rows already hold their primary block: merge
                l_cur = lse_rows.index_select(0, rows)
                top = torch.maximum(l_cur, l_t)  # weights relative to the larger: exact differences, sum in [1, 2]
                w_cur, w_t = torch.exp(l_cur - top), torch.exp(l_t - top)
                den = w_cur + w_t
                o_t = out.index_select(0, rows) * (w_cur / den)[..., None] + o_t * (w_t / den)[..., None]
                l_t = top + torch.log(den)
            out.index_copy_(0, rows, o_t)
            if m:  # read back by a later merge, or saved for backward
                lse_rows.index_copy_(0, rows, l_t)
        if sinks is not None:  # the last merge of every real row; padding rows (lse -inf) stay exactly 0
            lse_rows.index_fill_(0, pad_rows, -torch.inf)
            l_cur, sink = lse_rows[:Tq], sinks.to(acc)[None, :]
            out[:Tq] *= torch.sigmoid(l_cur - sink)[..., None]  # = exp(lse - lse'), precise near 1
            lse_rows[:Tq] = torch.logaddexp(l_cur, sink)
        out_acc, out = out, out.to(q_tok.dtype)
        saved = []
        for b, o, lse, rows, (n, lq), m in zip(plan.buckets, outs, lses, rows_of, qshape, merged):
            if m:  # this bucket's rows as merged (a padded slot's spare row holds its own values)
                o = out.index_select(0, rows).view(n, lq, Hq, D).transpose(1, 2)
                lse = lse_rows.index_select(0, rows).view(n, lq, Hq).transpose(1, 2)
            saved += [o, lse.contiguous()]
        ctx.has_sinks = sinks is not None
        ctx.exact_delta = sinks is not None and out_acc.dtype != out.dtype
        if ctx.exact_delta:  # the float32 merged output, spare rows included (see _fused_bwd_exact_delta)
            saved += [out_acc]
        if sinks is not None:  # for the sinks' gradient (copies: the caller may modify the output in place)
            saved += [out_acc[:Tq] if ctx.exact_delta else out[:Tq].clone(), lse_rows[:Tq].clone(), sinks]
        ctx.save_for_backward(q_rows, kv_buf, g_q, g_kv, *saved)
        ctx.plan, ctx.shapes, ctx.heads, ctx.scale = plan, (qshape, kshape), (Hq, heads_kv, D), scale
        ctx.sizes = (q_tok.shape, kv_buf.shape)
        # the Tq query rows over the buffer's storage, as a tensor rather than a view (autograd forbids in-place
        # ops on views made inside a custom Function, and the caller may modify its output in place)
        return out.new_empty(0).set_(out.untyped_storage(), 0, (Tq, Hq, D), (Hq * D, D, 1))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        q_rows, kv_buf, g_q, g_kv, *saved = ctx.saved_tensors
        plan, (qshape, kshape), (Hq, Hkv, D) = ctx.plan, ctx.shapes, ctx.heads
        dsinks = None
        if ctx.has_sinks:
            out_rows, lse_rows, sinks = saved[-3:]
            saved = saved[:-3]
            acc = lse_rows.dtype
            delta = (grad_out.to(acc) * out_rows.to(acc)).sum(-1)  # [Tq, Hq]
            dsinks = -(torch.exp(sinks.to(acc)[None, :] - lse_rows) * delta).sum(0).to(sinks.dtype)
        out_acc = saved.pop() if ctx.exact_delta else None
        q_shape, kv_shape = ctx.sizes
        acc = accumulation_dtype(q_rows.dtype)  # a row's gradient from several buckets: summed in float32 or better
        dq_tok = g_q.new_zeros((q_shape[0], Hq * D), dtype=acc)
        dkv = g_kv.new_zeros(kv_shape, dtype=acc)
        dk_half, dv_half = dkv[:, : Hkv * D], dkv[:, Hkv * D :]
        q_starts, k_starts = [b.q_start for b in plan.buckets], [b.k_start for b in plan.buckets]
        qs = _operands(q_rows, g_q, q_starts, qshape, [(Hq, D)])
        kvs = _operands(kv_buf, g_kv, k_starts, kshape, [(Hkv, D), (Hkv, D)])
        q_idx = iter(_split(plan.q_rest, [sh for st, sh in zip(q_starts, qshape) if st < 0]))
        k_idx = iter(_split(plan.k_rest, [sh for st, sh in zip(k_starts, kshape) if st < 0]))
        rows_of = _split(plan.out_rows, qshape)
        for i, (b, q, k, v, (n, lq), (_, lk)) in enumerate(zip(plan.buckets, qs, kvs[0::2], kvs[1::2], qshape, kshape)):
            rows = rows_of[i]
            do = grad_out.index_select(0, rows.clamp(max=q_shape[0] - 1))
            if b.padded:  # a padded slot's output was dropped: zero gradient
                do.masked_fill_((rows >= q_shape[0])[:, None, None], 0.0)
            do = do.view(n, lq, Hq, D).transpose(1, 2)
            if out_acc is None:
                dq, dk, dv = _fused_bwd(do, q, k, v, saved[2 * i], saved[2 * i + 1], 0.0, b.causal,
                                        attn_mask=_additive(b.mask, q.dtype), scale=ctx.scale)
            else:
                o_acc = out_acc.index_select(0, rows).view(n, lq, Hq, D).transpose(1, 2)
                dq, dk, dv = _fused_bwd_exact_delta(do, q, k, v, saved[2 * i], o_acc, saved[2 * i + 1], b.causal,
                                                    _additive(b.mask, q.dtype), ctx.scale)
            qi, ki = (None if b.q_start >= 0 else next(q_idx)), (None if b.k_start >= 0 else next(k_idx))
            _accumulate(dq_tok, b.q_start, qi, dq.transpose(1, 2).reshape(n * lq, Hq * D))
            _accumulate(dk_half, b.k_start, ki, dk.transpose(1, 2).reshape(n * lk, Hkv * D))
            _accumulate(dv_half, b.k_start, ki, dv.transpose(1, 2).reshape(n * lk, Hkv * D))
        return dq_tok.view(q_shape).to(q_rows.dtype), dkv.to(kv_buf.dtype), None, None, None, None, dsinks


def _fused_bwd_exact_delta(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, o_acc: Tensor, lse: Tensor,
                           causal: bool, attn_mask: Tensor | None, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """The fused backward of one bucket (``do, q, o [n, Hq, Lq, D]``, ``k, v [n, Hkv, Lk, D]``, ``lse [n, Hq, Lq]``)
    whose row term ``delta = do . out`` is that of ``o_acc`` (float32), not of ``o`` (``o_acc`` rounded to the
    inputs' dtype): returns ``(dq, dk, dv)`` like ``_fused_bwd``.

    The kernel forms ``dS = P * (do . v_j - delta)`` with ``delta`` from the output it is given. After the
    sinks' scaling a row's ``do . v_j`` and ``delta`` nearly cancel when the row's keys outweigh its sink, and
    the output's rounding (eps * |do| |out|) is then the whole difference: a key's gradient off by up to ~10% in
    bfloat16 (a document of one token). The missing part ``r = do . (o_acc - o)`` travels as one more head-dim
    column: ``do`` gains ``r``, ``o`` gains 1, and q, k, v gain 0, so that scores, ``do . v_j`` and the softmax are
    unchanged while the kernel's ``delta`` becomes ``do . o + r`` (``r`` itself rounded: an error of eps^2).
    """
    D = q.shape[-1]
    r = (do.to(o_acc.dtype) * (o_acc - o.to(o_acc.dtype))).sum(-1, keepdim=True)

    def widen(t: Tensor, col: Tensor | float) -> Tensor:
        extra = col.to(t.dtype) if isinstance(col, Tensor) else t.new_full((*t.shape[:-1], 1), col)
        return torch.cat([t, extra], -1)

    dq, dk, dv = _fused_bwd(widen(do, r), widen(q, 0.0), widen(k, 0.0), widen(v, 0.0), widen(o, 1.0), lse, 0.0, causal,
                            attn_mask=attn_mask, scale=1.0 / math.sqrt(D) if scale is None else scale)
    return dq[..., :D], dk[..., :D], dv[..., :D]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient summed from several blocks accumulates in: float32 for half inputs (each block's
    gradient is rounded once, the sum once more), the input's own otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _operands(src: Tensor, gathered: Tensor, starts: list[int], shapes: list[tuple[int, int]],
              split: list[tuple[int, int]]) -> list[Tensor]:
    """Per bucket ``[n, H, Ls, d]`` views for each column range ``(heads, dim)`` of ``split`` (the columns of a
    row hold the ranges side by side): of ``src`` rows ``[s, s + Ls)`` for a bucket that is one range starting
    at ``s``, else of its rows of ``gathered`` (the other buckets' rows, in bucket order)."""
    outs, o = [], 0
    for s, (n, ls) in zip(starts, shapes):
        if s >= 0:
            rows = src[s : s + ls].unsqueeze(0)
        else:
            rows = gathered[o : o + n * ls].unflatten(0, (n, ls))
            o += n * ls
        col = 0
        for heads, dim in split:
            outs.append(rows[..., col : col + heads * dim].unflatten(2, (heads, dim)).transpose(1, 2))
            col += heads * dim
    return outs


def _accumulate(dst: Tensor, start: int, index: Tensor | None, grad: Tensor) -> None:
    """Add a bucket's gradient rows into ``dst``: into rows ``[start, start + len)`` when the bucket is one
    range, else at rows ``index``."""
    if index is None:
        dst[start : start + grad.shape[0]].add_(grad)
    else:
        dst.index_add_(0, index, grad.to(dst.dtype))


def _split(flat: Tensor, shapes: list[tuple[int, int]]) -> list[Tensor]:
    """``flat`` cut into consecutive pieces of ``n * l`` elements for each ``(n, l)``."""
    return list(flat.split([n * ln for n, ln in shapes]))


# ---- the masked plan: gathers and scatter with one pass each way (autograd's own would zero-fill full-size
# buffers per bucket)
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
        first = next(g for g in grads if g is not None)
        shape, dtype = first.shape, first.dtype
        out = first.new_zeros((ctx.rows, shape[1], shape[3]), dtype=accumulation_dtype(dtype))
        o = 0
        for grad, (n, lq) in zip(grads, ctx.shapes):
            if grad is not None:
                out.index_add_(0, index[o : o + n * lq], grad.transpose(1, 2).reshape(n * lq, shape[1], shape[3]).to(out.dtype))
            o += n * lq
        return out.to(dtype), None, None


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
        first = next(g for g in grads if g is not None)
        out = first.new_zeros(ctx.buf_shape, dtype=accumulation_dtype(first.dtype))
        k_half, v_half = out[:, : ctx.kd], out[:, ctx.kd :]
        o = 0
        for b, (n, lk) in enumerate(ctx.lens):
            idx = index[o : o + n * lk]
            for grad, half in ((grads[2 * b], k_half), (grads[2 * b + 1], v_half)):
                if grad is not None:
                    half.index_add_(0, idx, grad.transpose(1, 2).reshape(n * lk, -1).to(out.dtype))
            o += n * lk
        return out.to(first.dtype), None, None, None, None


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
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """``q_tok [Tq, Hq, D]`` and the key buffer ``kv_buf [Tk, Hkv * (D + Dv)]`` (keys then values per token)
    -> ``[Tq, Hq, Dv]``; padding rows exactly 0.

    The maskless blocks when the fused op can run them (see :func:`fused_unusable_reason`), else the masked
    plan. Either way: one gather for all queries, one for all keys and values, one scatter for all outputs,
    whatever the number of buckets (and one pass each in backward).

    Variants: ``sinks [Hq]`` join the fused blocks' log-sum-exp merge; a ``softcap`` (which the fused op lacks)
    runs the same blocks with explicit scores (:data:`SOFTCAP_PLAN`, chosen by measurement: ``bench`` section
    ``variants``), and the masked plan runs explicit scores whenever a variant is given. flash-attn takes the
    soft-cap itself; it has no sinks (``use_flash`` is never set with sinks).
    """
    Hq, D = q_tok.shape[1], q_tok.shape[2]
    if meta.plain is not None:  # pieces without blocks on their own paths, those with blocks masked; rows disjoint
        rest = _attention(q_tok, kv_buf, meta.plain, heads_kv, dim_v, dropout_p, scale, use_flash, sinks, softcap)
        return rest + _attention(q_tok, kv_buf, meta, heads_kv, dim_v, dropout_p, scale, False, sinks, softcap)
    return _attention(q_tok, kv_buf, meta, heads_kv, dim_v, dropout_p, scale, use_flash, sinks, softcap)


def _attention(q_tok: Tensor, kv_buf: Tensor, meta: VarlenMeta, heads_kv: int, dim_v: int, dropout_p: float,
               scale: float | None, use_flash: bool, sinks: Tensor | None, softcap: float | None) -> Tensor:
    """:func:`varlen_attention` over the pieces of ``meta`` itself (not ``meta.plain``'s); other rows 0."""
    Hq, D = q_tok.shape[1], q_tok.shape[2]
    if not meta.piece_q.shape[0]:  # this rank holds only padding: zeros that still reach q and the key buffer
        return _zero_rows(q_tok, kv_buf, meta.num_queries, Hq, dim_v, sinks)  # (flash-attn refuses 0 sequences)
    if use_flash and meta.labels is None:
        kd = heads_kv * D
        k_buf, v_buf = kv_buf[:, :kd].unflatten(1, (heads_kv, D)), kv_buf[:, kd:].unflatten(1, (heads_kv, dim_v))
        return _flash_varlen(q_tok, k_buf, v_buf, meta, dropout_p=dropout_p, scale=scale, softcap=softcap)
    if meta.labels is None and dropout_p == 0 and meta.sees_only_itself:
        return _own_key(q_tok, kv_buf, meta, heads_kv, dim_v, scale, sinks, softcap)
    variants = sinks is not None or softcap is not None
    if meta.labels is None and fused_unusable_reason(q_tok, D, dim_v, dropout_p) is None:
        if softcap is None:
            return _MergedBlocks.apply(q_tok, kv_buf, meta.pad_rows, meta.blocks, heads_kv, scale, sinks)
        if SOFTCAP_PLAN == "blocks":
            return _explicit_blocks(q_tok, kv_buf, meta, heads_kv, dim_v, scale, softcap, sinks)
    plan = meta.masked(q_tok.device)
    gqa = Hq != heads_kv
    qs = _GatherQueries.apply(q_tok, plan.q_gather, [b.q_index.shape for b in plan.buckets])
    kvs = _GatherKeysValues.apply(kv_buf, plan.k_gather, [b.k_index.shape for b in plan.buckets], heads_kv, D)
    if variants:
        outs = [
            explicit_attention(q, k, v, b.mask, causal=b.mask is None, scale=scale, softcap=softcap, sinks=sinks,
                               dropout_p=dropout_p)
            for b, q, k, v in zip(plan.buckets, qs, kvs[0::2], kvs[1::2])
        ]
    else:
        outs = [
            stock_sdpa(q, k, v, attn_mask=b.mask, dropout_p=dropout_p, is_causal=b.mask is None, scale=scale, enable_gqa=gqa)
            for b, q, k, v in zip(plan.buckets, qs, kvs[0::2], kvs[1::2])
        ]
    return _ScatterOutputs.apply(plan.out_rows, meta.pad_rows, meta.num_queries, *outs)


def _own_key(q_tok: Tensor, kv_buf: Tensor, meta: VarlenMeta, heads_kv: int, dim_v: int, scale: float | None,
             sinks: Tensor | None, softcap: float | None) -> Tensor:
    """Every real query sees only its own key: without sinks exactly its value (a softmax of one score is 1; q and k
    get exactly 0 gradient, where a fused kernel's backward gives them rounding noise, ``rowsum(dO * O) - dO . v``),
    with sinks the value weighed by :func:`own_key_attention` (the fused blocks' merge added that noise to the score's
    gradient)."""
    Hq, D = q_tok.shape[1], q_tok.shape[2]
    g = Hq // heads_kv
    rows, keys = meta.self_keys(q_tok.device)
    own_kv = kv_buf.index_select(0, keys)
    v_own = own_kv[:, heads_kv * D :].unflatten(1, (heads_kv, dim_v)).repeat_interleave(g, dim=1)
    zeros = _zero_rows(q_tok, kv_buf, meta.num_queries, Hq, dim_v, sinks)  # q, the keys and sinks stay in the graph
    if sinks is None:
        return zeros.index_copy(0, rows, v_own)
    k_own = own_kv[:, : heads_kv * D].unflatten(1, (heads_kv, D)).repeat_interleave(g, dim=1)
    return zeros.index_copy(0, rows, own_key_attention(q_tok.index_select(0, rows), k_own, v_own, sinks[None, :], scale,
                                                       softcap))


def _explicit_blocks(q_tok: Tensor, kv_buf: Tensor, meta: VarlenMeta, heads_kv: int, dim_v: int, scale: float | None,
                     softcap: float | None, sinks: Tensor | None) -> Tensor:
    """The maskless blocks with explicit scores (a soft-cap), merged by log-sum-exp, all through autograd.

    Same blocks, slots and spare rows as :class:`_MergedBlocks`: a block's causal kind is top-left causal in
    its slots (a band's slots run in reverse). The primary blocks (one per real row) are placed with one copy,
    then the secondary ones (at most one per row) merged into their rows with one more, and sinks are one more
    block of every real row (logsumexp ``sinks[h]``, output 0)."""
    plan = meta.blocks
    Hq, D = q_tok.shape[1], q_tok.shape[2]
    qshape = [tuple(b.q_index.shape) for b in plan.buckets]
    qs = _GatherQueries.apply(q_tok, plan.q_gather, qshape)
    kvs = _GatherKeysValues.apply(kv_buf, plan.k_gather, [tuple(b.k_index.shape) for b in plan.buckets], heads_kv, D)
    outs, lses = {False: [], True: []}, {False: [], True: []}  # by secondary: (rows, values)
    for b, q, k, v, rows in zip(plan.buckets, qs, kvs[0::2], kvs[1::2], _split(plan.out_rows, qshape)):
        need_lse = b.merged or sinks is not None  # a row merged with another block, or with its sink
        res = explicit_attention(q, k, v, b.mask, causal=b.causal, scale=scale, softcap=softcap, return_lse=True,
                                 lse_needed=need_lse)
        outs[b.secondary].append((rows, res[0].transpose(1, 2).reshape(-1, Hq, dim_v)))
        if need_lse:
            lses[b.secondary].append((rows, res[1].transpose(1, 2).reshape(-1, Hq)))
    rows, o_p = (torch.cat(t) for t in zip(*outs[False]))
    out = o_p.new_zeros((plan.num_rows, Hq, dim_v)).index_copy(0, rows, o_p)
    lse = out.new_full((plan.num_rows, Hq), -torch.inf)
    if lses[False]:  # rows never merged keep -inf: nothing reads them
        rows, l_p = (torch.cat(t) for t in zip(*lses[False]))
        lse = lse.index_copy(0, rows, l_p)
    if outs[True]:  # rows of secondary blocks are distinct (a padded slot's spare row merges with nothing)
        (rows, o_s), (_, l_s) = (torch.cat(t) for t in zip(*outs[True])), (torch.cat(t) for t in zip(*lses[True]))
        l_cur = lse.index_select(0, rows)
        top = torch.maximum(l_cur, l_s)  # weights relative to the larger: exact differences, sum in [1, 2]
        w_cur, w_s = torch.exp(l_cur - top), torch.exp(l_s - top)
        den = w_cur + w_s
        merged = (out.index_select(0, rows) * w_cur[..., None] + o_s * w_s[..., None]) / den[..., None]
        out, lse = out.index_copy(0, rows, merged), lse.index_copy(0, rows, top + torch.log(den))
    Tq = meta.num_queries
    out, lse = out[:Tq], lse[:Tq]  # padding rows: never written, exactly 0 (lse -inf)
    if sinks is not None:
        out = out * TwoTailedSigmoid.apply(lse - sinks.to(lse.dtype)[None, :])[..., None]  # = exp(lse - lse')
    return out.to(q_tok.dtype)


def _zero_rows(q_tok: Tensor, kv_buf: Tensor, rows: int, Hq: int, Dv: int, sinks: Tensor | None = None) -> Tensor:
    """Exact zeros ``[rows, Hq, Dv]`` that still reach q, the key buffer (and the sinks) in the graph (with
    exactly 0 gradient), so that a rank holding only padding runs the exchange's backward like every other rank."""
    zero = graph_zero(q_tok, kv_buf, sinks)
    return zero.expand(rows, Hq, Dv).clone(memory_format=torch.contiguous_format)  # writable, like other ranks' output


def _flash_varlen(q_tok, k_buf, v_buf, meta: VarlenMeta, *, dropout_p: float, scale: float | None,
                  softcap: float | None = None) -> Tensor:
    fm = meta.flash_meta(q_tok.device)
    extra = {} if softcap is None else {"softcap": softcap}  # flash-attn >= 2.6
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
        **extra,
    )
    return torch.cat([out, out.new_zeros((1,) + tuple(out.shape[1:]))]).index_select(0, fm["out_index"])
