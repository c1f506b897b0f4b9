"""The shard plan: which global positions each rank holds (pure, identical on every rank), and the segment ids of the
padded stream. The lowest floor of the step's plans: :mod:`blockdiag_dist.docs` (documents for any mixer) and
:mod:`blockdiag_dist.plan` (the attention exchange) both build on it.

Shape legend:
    B     batch rows                 S     sequence length given       Sp    padded length = W * L
    W     CP world size              L     rows held by one rank
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from .balance import CumulativeWork, balanced_positions, balanced_runs, interval_ranges

__all__ = ["FlatIndex", "ShardPlan", "interval_ranges", "padded_doc_starts", "padded_segments", "plan_shards"]


class ShardPlan:
    """Which global positions each rank holds. Row ``l`` of rank ``r`` is position ``positions[r, l]``.

    Positions ``>= seq_len`` are CP padding (added so that every rank holds ``local_len`` rows). Stored as
    *runs*: ``runs`` int64 ``[R, 4]``, one row ``(rank, start, length, local_start)`` per maximal run of
    consecutive positions that a rank holds on consecutive local rows, in rank order then local order (so the
    runs of a rank tile its rows ``0 .. L-1``). Contiguous shards are one run per rank, balanced ones a few:
    everything the plans derive from a shard costs what its runs cost, never its rows. Build it from runs or
    from ``positions [W, L]`` (a permutation of ``range(W * L)``); the other is derived when asked for.

    >>> ShardPlan(world=2, seq_len=5, local_len=3, positions=torch.tensor([[0, 1, 2], [3, 4, 5]])).runs.tolist()
    [[0, 0, 3, 0], [1, 3, 3, 0]]
    """

    def __init__(self, world: int, seq_len: int, local_len: int, positions: Tensor | None = None,
                 layout: str = "contiguous", *, runs: Tensor | None = None) -> None:
        if (positions is None) == (runs is None):
            raise ValueError("ShardPlan: expected exactly one of positions [W, L] and runs [R, 4], got "
                             f"{'both' if runs is not None else 'neither'}")
        self.world, self.seq_len, self.local_len, self.layout = world, seq_len, local_len, layout
        if positions is not None:
            self.__dict__["positions"] = positions
        else:
            self.__dict__["runs"] = runs

    def with_layout(self, layout: str) -> ShardPlan:
        """The same shards under another layout name (``auto:<choice>``)."""
        out = ShardPlan(self.world, self.seq_len, self.local_len, layout=layout, runs=self.runs)
        if "positions" in self.__dict__:
            out.__dict__["positions"] = self.__dict__["positions"]
        return out

    def __repr__(self) -> str:
        return (f"ShardPlan(world={self.world}, seq_len={self.seq_len}, local_len={self.local_len}, "
                f"layout={self.layout!r}, runs={self.runs.shape[0]})")

    @property
    def padded_len(self) -> int:
        return self.world * self.local_len

    @cached_property
    def runs(self) -> Tensor:
        pos = self.positions  # [W, L]
        W, L = pos.shape
        first = torch.ones(W, L, dtype=torch.bool)
        first[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        rank, local = first.nonzero().unbind(1)
        flat = rank * L + local
        length = torch.diff(torch.cat([flat, torch.tensor([W * L])]))
        return torch.stack([rank, pos[rank, local], length, local], 1)

    @cached_property
    def positions(self) -> Tensor:
        """int64 ``[W, L]``: the global position of every rank's every row (token-level; built when asked)."""
        return torch.stack([self.rank_positions(r) for r in range(self.world)]) if self.world else self.runs[:0]

    def rank_runs(self, rank: int) -> Tensor:
        """Rank ``rank``'s runs ``[R_r, 4]``, local order."""
        lo, hi = self._rank_bounds[rank], self._rank_bounds[rank + 1]
        return self.runs[lo:hi]

    @cached_property
    def _rank_bounds(self) -> list[int]:
        return torch.searchsorted(self.runs[:, 0].contiguous(), torch.arange(self.world + 1)).tolist()

    def rank_positions(self, rank: int) -> Tensor:
        """int64 ``[L]``: the global positions of rank ``rank``'s rows (this rank's only)."""
        if "positions" in self.__dict__:
            return self.__dict__["positions"][rank]
        runs = self.rank_runs(rank)
        return interval_ranges(runs[:, 1], runs[:, 2])

    @cached_property
    def by_position(self) -> Tensor:
        """The runs sorted by start position, ``[R, 4]`` (they tile ``[0, W * L)``)."""
        return self.runs[torch.argsort(self.runs[:, 1])]

    @cached_property
    def _by_rank_position(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(keys rank * (Sp + 1) + start, ranks, starts, lengths, rows of the rank before each run), runs sorted by
        key; numpy (its calls cost a microsecond where torch's cost tens, and plans are many small calls)."""
        runs = self.runs.numpy()
        key = runs[:, 0] * (self.padded_len + 1) + runs[:, 1]
        order = np.argsort(key, kind="stable")
        key, runs = key[order], runs[order]
        before = np.cumsum(runs[:, 2]) - runs[:, 2]
        base = before[np.searchsorted(key, np.arange(self.world) * (self.padded_len + 1))]
        return key, runs[:, 0], runs[:, 1], runs[:, 2], before - base[runs[:, 0]]

    def rows_before(self, rank: Tensor | np.ndarray, x: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """int64: how many of the positions ``< x`` rank ``rank`` holds (elementwise), from its runs (a tensor
        for a tensor ``x``, an array for an array)."""
        key, run_rank, start, length, before = self._by_rank_position
        r = rank.numpy() if isinstance(rank, Tensor) else np.asarray(rank)
        xs = x.numpy() if isinstance(x, Tensor) else x
        j = np.searchsorted(key, r * (self.padded_len + 1) + xs, side="right") - 1  # every rank holds a run
        jc = np.maximum(j, 0)
        out = np.where((j >= 0) & (run_rank[jc] == r), before[jc] + np.minimum(xs - start[jc], length[jc]), 0)
        return torch.from_numpy(out) if isinstance(x, Tensor) else out

    def locate(self, p: Tensor) -> tuple[Tensor, Tensor]:
        """``(owner rank, local row)`` of positions ``p`` (any shape), from the runs."""
        runs = self.by_position
        k = torch.searchsorted(runs[:, 1].contiguous(), p, right=True) - 1
        return runs[k, 0], runs[k, 3] + p - runs[k, 1]

    @cached_property
    def owner(self) -> Tensor:
        """int64 ``[Sp]``: the rank holding each position (token-level; built when asked)."""
        return self.locate(torch.arange(self.padded_len))[0]

    @cached_property
    def owner_row(self) -> Tensor:
        """int64 ``[Sp]``: the local row index of each position on its owner (token-level; built when asked)."""
        return self.locate(torch.arange(self.padded_len))[1]


class FlatIndex:
    """The row of each flat id in a buffer of flat ids, -1 where absent, from the buffer's runs of consecutive
    ids (``searchsorted``): indexed like a ``[B * Sp]`` lookup tensor, with memory ``O(runs)``.

    >>> index = FlatIndex(torch.tensor([7, 8, 9, 2, 3]))
    >>> index[torch.tensor([2, 3, 4, 9, 0])].tolist()
    [3, 4, -1, 2, -1]
    """

    DENSE_UP_TO = 1 << 16  # a flat space this small gets a plain lookup table (faster for small batches)
    WINDOW_FROM = 1 << 12  # this many ids or more, over a span at most WINDOW_SPAN times as long: a table of the span
    WINDOW_SPAN = 4
    SPAN_SLACK = 4096  # ragged blocks (rows_in_blocks): spans this much beyond WINDOW_SPAN times their ids still get tables

    def __init__(self, flat: Tensor, space: int | None = None) -> None:
        first = torch.ones(flat.numel(), dtype=torch.bool)
        first[1:] = flat[1:] != flat[:-1] + 1
        row = first.nonzero().flatten()
        length = torch.diff(torch.cat([row, torch.tensor([flat.numel()])]))
        self._set(flat[row], length, row, space)

    @classmethod
    def from_runs(cls, start: Tensor, length: Tensor, row: Tensor | None = None, space: int | None = None) -> FlatIndex:
        """The buffer that holds runs of flat ids ``[start, start + length)`` from buffer row ``row`` on (default:
        one after the other). ``space``: the number of flat ids (``B * Sp``), when known."""
        out = cls.__new__(cls)
        out._set(start, length, torch.cumsum(length, 0) - length if row is None else row, space)
        return out

    def _set(self, start: Tensor, length: Tensor, row: Tensor, space: int | None) -> None:
        order = torch.argsort(start)
        self.start, self.row, self.length = start[order].contiguous(), row[order], length[order]
        self.numel = int(length.sum()) if length.numel() else 0
        self._table = None
        if space is not None and space <= self.DENSE_UP_TO:
            self._table = torch.full((space,), -1, dtype=torch.int64)
            self._table[interval_ranges(self.start, self.length)] = interval_ranges(self.row, self.length)

    def flat_ids(self) -> Tensor:
        """int64 ``[numel]``: the flat id at each row of the buffer (token-level)."""
        order = torch.argsort(self.row)
        return interval_ranges(self.start[order], self.length[order])

    def __getitem__(self, x: Tensor) -> Tensor:
        if self._table is not None:
            return self._table[x]
        if self.start.numel() == 0:
            return torch.full_like(x, -1)
        if x.numel() >= self.WINDOW_FROM:
            lo, hi = int(x.min()), int(x.max())
            if hi - lo + 1 <= self.WINDOW_SPAN * x.numel():
                return self._window(lo, hi + 1)[x - lo]
        k = torch.searchsorted(self.start, x, right=True) - 1
        kc = k.clamp(min=0)
        off = x - self.start[kc]
        return torch.where((k >= 0) & (off < self.length[kc]), self.row[kc] + off, -1)

    def _window(self, lo: int, hi: int) -> Tensor:
        """The lookup table of flat ids ``[lo, hi)`` (``-1`` where absent), from the runs that meet the span: their
        intersections with it, one range each (memory ``O(hi - lo)``, no search per id)."""
        table = torch.full((hi - lo,), -1, dtype=torch.int64)
        end = self.start + self.length
        meet = (self.start < hi) & (end > lo)
        s, e = self.start[meet].clamp(min=lo), end[meet].clamp(max=hi)
        table[interval_ranges(s - lo, e - s)] = interval_ranges(self.row[meet] + (s - self.start[meet]), e - s)
        return table

    def rows_of(self, x: Tensor) -> Tensor:
        """``self[x]`` for ``x [n, m]`` whose rows each span few flat ids (a block's keys): a row whose span
        ``[min, max]`` lies in one run of the buffer is that run's row offset plus ``x`` (one ``searchsorted`` per
        row, not per id); the others are looked up id by id.

        >>> index = FlatIndex(torch.tensor([7, 8, 9, 2, 3]))
        >>> index.rows_of(torch.tensor([[7, 9, 8], [3, 4, 2]])).tolist()
        [[0, 2, 1], [4, -1, 3]]
        """
        if x.dim() != 2:
            return self[x]
        return self.rows_in_blocks(x.flatten(), torch.full((x.shape[0],), x.shape[1], dtype=torch.int64)).view(x.shape)

    def rows_in_blocks(self, x: Tensor, lengths: Tensor) -> Tensor:
        """``self[x]`` for ``x [N]`` the concatenation of blocks of ``lengths`` ids, each spanning few flat ids:
        a block whose span ``[min, max]`` lies in one run of the buffer is that run's row offset plus ``x`` (one
        search per block, not per id, in numpy over the blocks); the others are looked up id by id.

        >>> index = FlatIndex(torch.tensor([7, 8, 9, 2, 3]))
        >>> index.rows_in_blocks(torch.tensor([7, 9, 8, 3, 4, 2]), torch.tensor([3, 0, 3])).tolist()
        [0, 2, 1, 4, -1, 3]
        """
        if self._table is not None or x.numel() == 0 or self.start.numel() == 0:
            return self[x]
        xn, n = x.numpy(), lengths.numpy()
        nz = n > 0
        at = (np.cumsum(n) - n)[nz]
        lo, hi = np.minimum.reduceat(xn, at), np.maximum.reduceat(xn, at)
        start, length, row = self.start.numpy(), self.length.numpy(), self.row.numpy()
        k = np.maximum(np.searchsorted(start, lo, side="right") - 1, 0)
        inside = np.ones(n.size, dtype=bool)
        inside[nz] = (lo >= start[k]) & (hi < start[k] + length[k])
        offset = np.zeros(n.size, dtype=np.int64)
        offset[nz] = row[k] - start[k]
        out = torch.from_numpy(xn + np.repeat(offset, n))
        if not inside.all():
            out[torch.from_numpy(np.repeat(~inside, n))] = torch.from_numpy(self._span_tables(xn, n, ~inside, lo, hi, nz))
        return out

    def _span_tables(self, xn: np.ndarray, n: np.ndarray, rest: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                     nz: np.ndarray) -> np.ndarray:
        """The rows of the ids of the blocks ``rest`` (bool over all blocks; ``lo``/``hi`` their spans, over the
        nonempty blocks ``nz``), from one lookup table per block over its span, filled from the runs that meet
        it (one range per intersection): ``O(ids + spans + intersections)``, no search per id. A block's ids are
        a few runs' worth of positions, so its span is about its length; where the spans add up to far more
        than the ids, a search per id."""
        start, length, row = self.start.numpy(), self.length.numpy(), self.row.numpy()
        blocks = np.flatnonzero(rest)
        span_of = np.zeros(n.size, dtype=np.int64)
        lo_of = np.zeros(n.size, dtype=np.int64)
        span_of[nz], lo_of[nz] = hi - lo + 1, lo
        b_lo, b_span = lo_of[blocks], span_of[blocks]
        ids = xn[np.repeat(rest, n)]
        if int(b_span.sum()) > self.WINDOW_SPAN * ids.size + self.SPAN_SLACK:
            j = np.searchsorted(start, ids, side="right") - 1
            jc = np.maximum(j, 0)
            off = ids - start[jc]
            return np.where((j >= 0) & (off < length[jc]), row[jc] + off, -1)
        base = np.cumsum(b_span) - b_span  # each block's table inside one concatenated table
        k0 = np.maximum(np.searchsorted(start, b_lo, side="right") - 1, 0)
        k1 = np.searchsorted(start, b_lo + b_span - 1, side="right") - 1
        cnt = np.maximum(k1 - k0 + 1, 0)
        blk = np.repeat(np.arange(blocks.size), cnt)
        run = _np_ranges(k0, cnt)
        s = np.maximum(start[run], b_lo[blk])
        e = np.minimum(start[run] + length[run], b_lo[blk] + b_span[blk])
        keep = e > s
        blk, run, s, e = blk[keep], run[keep], s[keep], e[keep]
        table = np.full(int(b_span.sum()), -1, dtype=np.int64)
        table[_np_ranges(base[blk] + s - b_lo[blk], e - s)] = _np_ranges(row[run] + s - start[run], e - s)
        per = np.repeat(np.arange(blocks.size), n[blocks])
        return table[base[per] + ids - b_lo[per]]


    def rows_of_ranges(self, first: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """int64 numpy: ``self[x]`` for ``x`` the concatenation of ``arange(f, f + n)`` over ``(first, lengths)``: each
        range met by the runs it crosses, one slice per intersection (no per-id search or table).

        >>> index = FlatIndex(torch.tensor([7, 8, 9, 2, 3]))
        >>> index.rows_of_ranges(np.array([1, 8]), np.array([4, 3])).tolist()
        [-1, 3, 4, -1, 1, 2, -1]
        """
        start, length, row = self.start.numpy(), self.length.numpy(), self.row.numpy()
        out = np.full(int(lengths.sum()), -1, dtype=np.int64)
        if start.size == 0 or out.size == 0:
            return out
        at = np.cumsum(lengths) - lengths  # where each range's rows go in ``out``
        k0 = np.maximum(np.searchsorted(start, first, side="right") - 1, 0)
        k1 = np.searchsorted(start, first + lengths - 1, side="right") - 1
        cnt = np.where(lengths > 0, np.maximum(k1 - k0 + 1, 0), 0)
        rng = np.repeat(np.arange(first.size), cnt)
        run = _np_ranges(k0, cnt)
        s = np.maximum(start[run], first[rng])
        e = np.minimum(start[run] + length[run], first[rng] + lengths[rng])
        keep = e > s
        dst, src, m = (at[rng] + s - first[rng])[keep], (row[run] + s - start[run])[keep], (e - s)[keep]
        if dst.size <= 4096:  # few long intersections: one slice each
            for d, r, k in zip(dst.tolist(), src.tolist(), m.tolist()):
                out[d:d + k] = np.arange(r, r + k)
        else:
            out[_np_ranges(dst, m)] = _np_ranges(src, m)
        return out


def _np_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + k)`` for each ``(s, k)`` (numpy)."""
    ends = np.cumsum(lengths)
    return np.arange(int(ends[-1]) if lengths.size else 0, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)


def plan_shards(seq_len: int, world: int, layout: str = "contiguous", *, work: Tensor | None = None) -> ShardPlan:
    """Which positions each rank holds.

    ``contiguous`` (the seed's sequential sharding): pad to a multiple of ``world``; rank ``r`` holds
    ``[r * L, (r + 1) * L)`` with ``L = ceil(S / W)``. ``balanced``: equal row counts with equalised attention
    work, from ``work [S]`` or, without a token-level tensor, from a :class:`~blockdiag_dist.balance.CumulativeWork`
    (see :mod:`blockdiag_dist.balance`).

    >>> plan_shards(5, 2).positions
    tensor([[0, 1, 2],
            [3, 4, 5]])
    """
    if world < 1:
        raise ValueError(f"world: expected a CP size >= 1, got {world}")
    if seq_len < 1:
        raise ValueError(f"seq_len: expected S >= 1, got {seq_len}")
    if layout == "contiguous":
        local_len = -(-seq_len // world)
        r = torch.arange(world)
        runs = torch.stack([r, r * local_len, torch.full_like(r, local_len), torch.zeros_like(r)], 1)
        return ShardPlan(world=world, seq_len=seq_len, local_len=local_len, layout=layout, runs=runs)
    if layout == "balanced":
        if isinstance(work, CumulativeWork):
            local_len, runs, _ = balanced_runs(work, world)
            return ShardPlan(world=world, seq_len=seq_len, local_len=local_len, layout=layout, runs=runs)
        if work is None or work.shape != (seq_len,):
            got = None if work is None else tuple(work.shape)
            raise ValueError(f"layout 'balanced': expected the work per position [S] = [{seq_len}], got {got}")
        local_len, positions, _ = balanced_positions(work, world)
        return ShardPlan(world=world, seq_len=seq_len, local_len=local_len, positions=positions, layout=layout)
    raise ValueError(f"layout: expected 'contiguous' or 'balanced', got {layout!r}")



def padded_segments(layout: DocLayout, shards: ShardPlan) -> Tensor:
    """Segment ids ``[B, Sp]`` (unique across rows; 0 = padding), CP padding appended."""
    return torch.nn.functional.pad(layout.segment_ids, (0, shards.padded_len - layout.seq_len))


def padded_doc_starts(layout: DocLayout, shards: ShardPlan) -> Tensor:
    """Start position of each token's document ``[B, Sp]`` (``-1`` on padding; token-level, for kernels and
    tests that take per-token tensors)."""
    return torch.nn.functional.pad(layout.doc_starts, (0, shards.padded_len - layout.seq_len), value=-1)
