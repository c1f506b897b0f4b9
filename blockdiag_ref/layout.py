"""Document layouts of packed rows: which positions form which document.

Shape legend:
    B    batch rows                    S    positions per row
    N    documents, all rows together  T    real (non-padding) tokens, all rows together
    Lq   query positions               Lk   key positions

A *document* is a maximal run of one non-zero id within a row. Id 0 is padding and may stand anywhere.
An id seen again after a different id (padding included) starts a new document: ``1 1 2 1`` holds three
documents, and so does ``1 0 1`` hold two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

__all__ = ["DocLayout", "normalize_chunk", "normalize_temperature", "normalize_window"]


def normalize_window(window_size: Sequence[int] | None) -> int:
    """Return the left extent of a causal ``window_size=(left, right)``; ``-1`` means unbounded.

    flash-attn's meaning: a query at position ``i`` sees keys ``j`` with ``i - left <= j <= i + right``; a
    negative side is unbounded. Causal attention forces ``right = 0``, so only ``right <= 0`` is accepted.

    >>> normalize_window(None), normalize_window((-1, -1)), normalize_window((4, 0))
    (-1, -1, 4)
    """
    if window_size is None:
        return -1
    if isinstance(window_size, (str, bytes)) or not isinstance(window_size, Sequence) or len(window_size) != 2:
        raise ValueError(f"window_size: expected None or a pair (left, right) of ints, got {window_size!r}")
    left, right = window_size
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right)):
        raise ValueError(f"window_size: expected a pair of ints, got {window_size!r}")
    if right > 0:
        raise ValueError(
            f"window_size: causal attention sees no future keys, so right must be <= 0 (0 or -1); "
            f"got right={right} in {window_size!r}"
        )
    return -1 if left < 0 else left


def normalize_chunk(chunk_size: int | None) -> int:
    """Return the chunk length of chunked local attention; ``-1`` means none.

    With chunks of ``C`` a query sees only the keys of its own chunk: positions ``0 .. C - 1`` of its document,
    then ``C .. 2C - 1``, and so on, counted from the document's start (as the model computes one document
    alone). Combined with causality (and a window, if any).

    >>> normalize_chunk(None), normalize_chunk(8)
    (-1, 8)
    """
    if chunk_size is None:
        return -1
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected None or an int >= 1 (positions per chunk), got {chunk_size!r}")
    return chunk_size


def normalize_temperature(temperature: Sequence[float] | None) -> tuple[float, float] | None:
    """Return ``(floor_scale, attn_scale)`` of Llama 4's NoPE query temperature; ``None`` means none.

    A query at position ``t`` of its document is multiplied by ``log1p(floor((t + 1) / floor_scale)) * attn_scale
    + 1`` (Llama 4's ``attn_temperature_tuning``; :func:`blockdiag_ref.temperature_scale`).

    >>> normalize_temperature(None), normalize_temperature((8192, 0.1))
    (None, (8192, 0.1))
    """
    if temperature is None:
        return None
    if isinstance(temperature, (str, bytes)) or not isinstance(temperature, Sequence) or len(temperature) != 2:
        raise ValueError(f"temperature: expected None or a pair (floor_scale, attn_scale) of numbers, got {temperature!r}")
    floor_scale, attn_scale = temperature
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (floor_scale, attn_scale)):
        raise ValueError(f"temperature: expected a pair (floor_scale, attn_scale) of numbers, got {temperature!r}")
    if not floor_scale > 0 or not math.isfinite(floor_scale) or not math.isfinite(attn_scale):
        raise ValueError(f"temperature: expected a finite floor_scale > 0 and a finite attn_scale, got {temperature!r}")
    return floor_scale, attn_scale


def _check_doc_ids(doc_ids: object, what: str = "doc_ids", check_values: bool = True) -> Tensor:
    """Validate a ``[B, S]`` doc-id tensor and return it as int64 (bool and any integer dtype accepted);
    ``check_values=False`` leaves the check of negative ids to the caller."""
    if not isinstance(doc_ids, Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor [B, S], got {type(doc_ids).__name__}")
    if doc_ids.dim() != 2:
        raise ValueError(f"{what}: expected 2 dims [B, S], got {doc_ids.dim()} dims with shape {tuple(doc_ids.shape)}")
    if doc_ids.is_floating_point() or doc_ids.is_complex():
        raise ValueError(f"{what}: expected bool or integer ids, got dtype {doc_ids.dtype}")
    if doc_ids.shape[0] < 1 or doc_ids.shape[1] < 1:
        raise ValueError(f"{what}: expected B >= 1 and S >= 1, got shape {tuple(doc_ids.shape)}")
    ids = doc_ids.to(torch.int64)
    if check_values and bool((ids < 0).any()):
        bad = int(ids.min())
        raise ValueError(f"{what}: expected ids >= 0 (0 = padding), got a negative id {bad}")
    return ids


class DocLayout:
    """Block-diagonal causal layout of ``B`` packed rows (in the spirit of xformers' ``BlockDiagonalMask``).

    Build it with :meth:`from_doc_ids` (one read of the ids), or from the documents themselves with
    :meth:`from_seqlens` or :meth:`from_segments` (no per-token tensor: what the planning reads costs what the
    documents cost, and the per-token tensors below are built on first use). Everything else is derived:

    - ``doc_ids``        int64 ``[B, S]``, 0 = padding, as given (from documents: ``1, 2, ...`` in each row)
    - ``segment_ids``    int64 ``[B, S]``, documents numbered ``1..N`` over all rows (row-major), 0 = padding;
                         unique across rows, so "same segment" implies "same row, same document"
    - ``padding_mask``   bool ``[B, S]``, True = padding
    - ``segments``       int64 ``[N, 3]``: ``(row, start, end)`` of each document, ``end`` exclusive
    - ``seqlens``        per-row lists of document lengths
    - ``cu_seqlens``     int32 ``[N + 1]`` document boundaries in the unpadded token stream (row-major);
                         with ``unpad_indices`` (int64 ``[T]``, flat indices into ``B * S``) and ``max_seqlen``
                         this is flash-attn's varlen vocabulary

    >>> layout = DocLayout.from_seqlens([3, 2], pad=1)
    >>> layout.doc_ids
    tensor([[1, 1, 1, 2, 2, 0]])
    >>> layout.seqlens, layout.max_seqlen
    ([[3, 2]], 3)
    >>> layout.cu_seqlens
    tensor([0, 3, 5], dtype=torch.int32)
    >>> layout.materialize_mask()[0, 0].int()
    tensor([[1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    >>> DocLayout.from_doc_ids(torch.tensor([[1, 1, 2, 1, 0, 1]])).seqlens   # a reused id starts a new document
    [[2, 1, 1, 1]]
    """

    def __init__(self, doc_ids: Tensor):
        ids = _check_doc_ids(doc_ids, check_values=False)
        self.__dict__["doc_ids"] = ids  # the cached_property's slot: as given, never rebuilt
        B, S = ids.shape
        self._shape = (B, S)
        # runs of one id: a new run wherever the id changes, and at every row start (one pass over the ids)
        flat = ids.flatten()
        a = flat.numpy()  # numpy: its comparison and flatnonzero read the ids about twice as fast as torch's ops
        change = np.empty(B * S, dtype=bool)
        np.not_equal(a[1:], a[:-1], out=change[1:])
        change[::S] = True
        run_start = np.flatnonzero(change)
        run_id = a[run_start]
        if (run_id < 0).any():  # every id is some run's id, so this checks them all
            raise ValueError(f"doc_ids: expected ids >= 0 (0 = padding), got a negative id {int(run_id.min())}")
        run_end = np.append(run_start[1:], B * S)
        real = run_id != 0
        start, end = run_start[real], run_end[real]
        row = start // S
        self.segments: Tensor = torch.from_numpy(np.stack([row, start - row * S, end - row * S], 1).astype(np.int64, copy=False))

    @cached_property
    def doc_ids(self) -> Tensor:
        """int64 ``[B, S]``: as given to :meth:`from_doc_ids`; built on first use for a layout made from its
        documents (``1, 2, ...`` in each row, 0 on padding)."""
        row = self.segments[:, 0].contiguous()
        first = torch.searchsorted(row, row)  # each row's first document
        return self._fill(torch.arange(self.num_docs) - first + 1)

    def _fill(self, values: Tensor) -> Tensor:
        """int64 ``[B, S]``: ``values[i]`` on the positions of document ``i``, 0 on padding (one pass)."""
        B, S = self._shape
        delta = torch.zeros(B * S + 1, dtype=torch.int64)
        flat = self.segments[:, 0] * S
        delta.index_put_((flat + self.segments[:, 1],), values, accumulate=True)
        delta.index_put_((flat + self.segments[:, 2],), -values, accumulate=True)
        return torch.cumsum(delta[:-1], 0).view(B, S)

    @cached_property
    def segment_ids(self) -> Tensor:
        return self._fill(torch.arange(1, self.num_docs + 1))

    @cached_property
    def padding_mask(self) -> Tensor:
        return self.segment_ids == 0

    @cached_property
    def unpad_indices(self) -> Tensor:
        return (~self.padding_mask).flatten().nonzero().flatten()

    @cached_property
    def cu_seqlens(self) -> Tensor:
        counts = self.segments[:, 2] - self.segments[:, 1]
        return torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)

    @classmethod
    def from_seqlens(
        cls,
        seqlens: Sequence[int] | Sequence[Sequence[int]],
        *,
        pad: int | Sequence[int] = 0,
    ) -> DocLayout:
        """Layout from document lengths, then ``pad`` trailing padding tokens per row.

        ``seqlens`` is one row (``[300, 20, 700]``) or one list per row (``[[3, 2], [5]]``); rows may differ
        and the shorter ones are padded to the longest. Documents of a row get ids ``1, 2, ...``.
        """
        if len(seqlens) > 0 and all(isinstance(x, int) and not isinstance(x, bool) for x in seqlens):
            rows = [list(seqlens)]
        else:
            rows = [list(r) for r in seqlens]
        if not rows:
            raise ValueError("seqlens: expected at least one row, got an empty sequence")
        pads = [pad] * len(rows) if isinstance(pad, int) else list(pad)
        if len(pads) != len(rows):
            raise ValueError(f"pad: expected an int or one value per row ({len(rows)} rows), got {len(pads)} values")
        for b, (row, p) in enumerate(zip(rows, pads)):
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in row):
                raise ValueError(f"seqlens: expected document lengths >= 1 (ints), got row {b} = {row!r}")
            if not isinstance(p, int) or p < 0:
                raise ValueError(f"pad: expected a padding count >= 0, got {p!r} for row {b}")
        seq_len = max(sum(row) + p for row, p in zip(rows, pads))
        if seq_len < 1:
            raise ValueError(f"seqlens/pad: expected a sequence length >= 1, got rows {rows} with pad {pads}")
        lengths = np.fromiter((n for row in rows for n in row), dtype=np.int64, count=sum(map(len, rows)))
        row_of = np.repeat(np.arange(len(rows), dtype=np.int64), [len(row) for row in rows])
        ends = np.cumsum(lengths)
        first = np.searchsorted(row_of, row_of)  # each row's first document
        ends -= np.concatenate([[0], ends])[first]  # ends within the row
        return cls._of_segments(np.stack([row_of, ends - lengths, ends], 1), len(rows), seq_len)

    @classmethod
    def from_segments(cls, segments: Tensor | np.ndarray, batch_size: int, seq_len: int) -> DocLayout:
        """Layout from its documents, int ``[N, 3]`` ``(row, start, end)`` (``end`` exclusive), in row-major
        order, each non-empty and inside ``[0, seq_len)``, none overlapping the next (adjacent ones are two
        documents); every other position is padding. ``O(N)``: no per-token tensor is built until one is read.

        >>> lay = DocLayout.from_segments(torch.tensor([[0, 0, 3], [0, 3, 5], [1, 1, 4]]), batch_size=2, seq_len=6)
        >>> lay.doc_ids.tolist(), lay.seqlens
        ([[1, 1, 1, 2, 2, 0], [0, 1, 1, 1, 0, 0]], [[3, 2], [3]])
        """
        seg = segments.detach().cpu().numpy() if isinstance(segments, Tensor) else np.asarray(segments)
        if seg.ndim != 2 or seg.shape[1] != 3 or not np.issubdtype(seg.dtype, np.integer):
            raise ValueError(f"segments: expected an integer array [N, 3] of (row, start, end), got {seg.dtype} of "
                             f"shape {tuple(seg.shape)}")
        for name, n in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {n!r}")
        seg = seg.astype(np.int64)  # a copy: the layout never shares the caller's array
        row, start, end = seg[:, 0], seg[:, 1], seg[:, 2]
        bad = (row < 0) | (row >= batch_size) | (start < 0) | (end <= start) | (end > seq_len)
        key_start, key_end = row * seq_len + start, row * seq_len + end
        bad[1:] |= key_start[1:] < key_end[:-1]  # out of order, or overlapping the one before
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"segments: expected non-empty (row, start, end) with 0 <= row < {batch_size}, 0 <= start < end <= "
                f"{seq_len}, in row-major order and not overlapping; got segment {i} = {seg[i].tolist()}"
                + (f" after {seg[i - 1].tolist()}" if i else "")
            )
        return cls._of_segments(seg, int(batch_size), int(seq_len))

    @classmethod
    def _of_segments(cls, segments: np.ndarray, batch_size: int, seq_len: int) -> DocLayout:
        """A layout of checked documents ``[N, 3]`` int64, without a doc-id tensor."""
        layout = cls.__new__(cls)
        layout._shape = (batch_size, seq_len)
        layout.segments = torch.from_numpy(np.ascontiguousarray(segments, dtype=np.int64).reshape(-1, 3))
        return layout

    @classmethod
    def from_doc_ids(cls, doc_ids: Tensor) -> DocLayout:
        """Layout from a doc-id tensor ``[B, S]`` (bool or integer; 0 = padding, ids >= 0)."""
        return cls(doc_ids)

    @property
    def batch_size(self) -> int:
        return self._shape[0]

    @property
    def seq_len(self) -> int:
        return self._shape[1]

    @property
    def num_docs(self) -> int:
        return self.segments.shape[0]

    @property
    def seqlens(self) -> list[list[int]]:
        rows: list[list[int]] = [[] for _ in range(self.batch_size)]
        for row, start, end in self.segments.tolist():
            rows[row].append(end - start)
        return rows

    @property
    def max_seqlen(self) -> int:
        return int((self.segments[:, 2] - self.segments[:, 1]).max()) if self.num_docs else 0

    @property
    def doc_starts(self) -> Tensor:
        """int64 ``[B, S]``: the start position of each token's document (``-1`` on padding)."""
        starts = torch.cat([torch.tensor([-1]), self.segments[:, 1]])
        return starts[self.segment_ids]

    @property
    def doc_positions(self) -> Tensor:
        """int64 ``[B, S]``: each token's position inside its document (``-1`` on padding).

        >>> DocLayout.from_seqlens([3, 2], pad=1).doc_positions.tolist()
        [[0, 1, 2, 0, 1, -1]]
        """
        return torch.where(self.segment_ids != 0, torch.arange(self.seq_len)[None, :] - self.doc_starts, -1)

    def chunked(self, chunk_size: int) -> DocLayout:
        """The layout whose documents are the chunks of ``chunk_size`` positions of each document, counted from
        the document's start: chunked local attention is block-diagonal causal attention over these.

        >>> DocLayout.from_seqlens([5, 3], pad=1).chunked(2).seqlens
        [[2, 2, 1, 2, 1]]
        """
        c = normalize_chunk(chunk_size)
        real = self.segment_ids != 0
        prev = torch.nn.functional.pad(self.segment_ids[:, :-1], (1, 0), value=0)
        offset = torch.arange(self.seq_len)[None, :] - self.doc_starts
        starts = real & ((self.segment_ids != prev) | (offset % c == 0))
        return DocLayout(torch.cumsum(starts.flatten(), 0).view_as(starts) * real)

    def materialize_mask(
        self,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        window_size: Sequence[int] | None = None,
        chunk_size: int | None = None,
        bidirectional_blocks: Tensor | None = None,
        whole_blocks: bool = False,
    ) -> Tensor:
        """Bool mask ``[B, 1, Lq, Lk]``: True where the query may see the key. Slow, for tests and references.

        Query at position ``i`` sees key ``j`` iff both lie in the same document, ``j <= i``, with a window
        ``i - left <= j``, and with chunks both lie in the same chunk of the document (``(i - start) // C ==
        (j - start) // C`` for the document's start position ``start``). ``q_positions`` / ``k_positions``
        (int64 ``[Lq]`` / ``[Lk]``, default all positions) select rows and columns, e.g. one rank's shard.

        ``bidirectional_blocks`` (int ``[B, S]``, 0 = no block): a query in a block also sees every later key of
        the same block id in its document (Gemma 3's image tokens): the window bounds only the keys before the query
        (see :meth:`block_labels`). With ``whole_blocks`` a query in a block sees every key of its block, before it
        too, beyond the window: the causal window OR the block (Gemma 4's and PaliGemma's sliding layers); without a
        window the two are the same mask.

        >>> lay = DocLayout.from_seqlens([3, 2])
        >>> lay.materialize_mask(bidirectional_blocks=torch.tensor([[1, 1, 0, 1, 1]]))[0, 0].int().tolist()
        [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
        """
        left = normalize_window(window_size)
        chunk = normalize_chunk(chunk_size)
        qp = torch.arange(self.seq_len) if q_positions is None else torch.as_tensor(q_positions, dtype=torch.int64)
        kp = torch.arange(self.seq_len) if k_positions is None else torch.as_tensor(k_positions, dtype=torch.int64)
        for name, pos in (("q_positions", qp), ("k_positions", kp)):
            if pos.dim() != 1 or (pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= self.seq_len)):
                raise ValueError(
                    f"{name}: expected a 1-D tensor of positions in [0, {self.seq_len}), got shape "
                    f"{tuple(pos.shape)}" + (f" with range [{int(pos.min())}, {int(pos.max())}]" if pos.numel() else "")
                )
        seg_q = self.segment_ids[:, qp][:, :, None]
        seg_k = self.segment_ids[:, kp][:, None, :]
        allowed = (seg_q == seg_k) & (seg_q != 0) & (kp[None, None, :] <= qp[None, :, None])
        if left >= 0:
            allowed &= kp[None, None, :] >= qp[None, :, None] - left
        if chunk > 0:
            start = self.doc_starts
            chunk_q = (qp[None, :] - start[:, qp]) // chunk
            chunk_k = (kp[None, :] - start[:, kp]) // chunk
            allowed &= chunk_q[:, :, None] == chunk_k[:, None, :]
        if bidirectional_blocks is not None:
            if chunk > 0:
                raise ValueError(f"bidirectional_blocks: expected no chunk_size with them, got chunk_size={chunk}")
            lab = self.block_labels(bidirectional_blocks)
            lab_q, lab_k = lab[:, qp][:, :, None], lab[:, kp][:, None, :]
            same = (lab_q == lab_k) & (lab_q != 0)
            allowed |= same if whole_blocks else same & (kp[None, None, :] > qp[None, :, None])
        return allowed[:, None]

    def block_labels(self, bidirectional_blocks: Tensor) -> Tensor:
        """int64 ``[B, S]``: one label per (document, block id) of ``bidirectional_blocks`` (int ``[B, S]``, 0 = no
        block), numbered 1, 2, ... in order of first token, 0 outside any block and on padding. Tokens of one
        block id in two documents are two blocks; a block id met again later in its document is the same block
        (as transformers' ``token_type_ids`` masks read it).

        >>> DocLayout.from_seqlens([3, 2], pad=1).block_labels(torch.tensor([[0, 2, 2, 2, 0, 2]])).tolist()
        [[0, 1, 1, 2, 0, 0]]
        """
        ids = bidirectional_blocks
        if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.is_complex() or tuple(ids.shape) != self._shape:
            got = (tuple(ids.shape), ids.dtype) if isinstance(ids, Tensor) else type(ids).__name__
            raise ValueError(f"bidirectional_blocks: expected an integer or bool tensor [B, S] = {list(self._shape)}, got {got}")
        ids = ids.detach().to("cpu", torch.int64)
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError(f"bidirectional_blocks: expected block ids >= 0 (0 = no block), got {int(ids.min())}")
        seg = self.segment_ids
        inside = ((ids != 0) & (seg != 0)).flatten()
        if not bool(inside.any()):
            return torch.zeros_like(seg)
        # one key per (document, block id), compacted: tables sized by the blocks met, never by the largest id
        pairs = torch.stack([seg.flatten()[inside], ids.flatten()[inside]], 1)
        _, key = torch.unique(pairs, dim=0, return_inverse=True)
        first = torch.full((int(key.max()) + 1,), inside.numel(), dtype=torch.int64)
        first.scatter_reduce_(0, key, inside.nonzero().flatten(), "amin")  # each block's first token
        rank = torch.empty_like(first)
        rank[torch.argsort(first)] = torch.arange(1, first.numel() + 1)  # labels 1, 2, ... in order of first token
        out = torch.zeros(inside.numel(), dtype=torch.int64)
        out[inside] = rank[key]
        return out.view_as(seg)

    def __repr__(self) -> str:
        return f"DocLayout(B={self.batch_size}, S={self.seq_len}, seqlens={self.seqlens})"
