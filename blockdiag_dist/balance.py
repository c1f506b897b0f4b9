"""Load-balanced sharding for packed documents (``layout="balanced"``): pure, identical on every rank.

Under causal document masks the attention work of a query is the number of keys it sees: ``p - doc_start + 1``
at position ``p``. Contiguous shards therefore get unequal work (the rank holding the end of a long document
does the most). Here the padded row is cut into ``c * W`` equal chunks and every rank gets exactly ``c`` of
them (so every rank still holds the same number of rows, and any S and CP work, with no divisibility rule),
chosen to equalise the summed work:

1. longest-processing-time first: chunks by decreasing work, each to the least-loaded rank that still has
   room (a rank takes exactly ``c`` chunks);
2. then pairwise swaps between the most and the least loaded rank while that lowers the maximum.

``c`` is the smallest of 2, 4, 8, 16, 32 that brings max/mean work within ``TARGET``; finer chunks balance
better but cut more documents across ranks (more K/V to exchange), so the coarsest good one wins. A rank's
chunks are kept in ascending order, so its rows stay in global order.

With ``B > 1`` the rows share one assignment (tensors are ``[B, L, ...]``): the work of a position is summed
over rows.

``snapped_positions`` is the same with chunk boundaries moved to the nearest document boundary (a position
where every row starts a document or is padding) wherever that keeps max/mean work and max/mean rows within
``SNAP_TARGET``: fewer documents are cut, so fewer keys move and fewer pieces need a prefix block. Chunks then
differ in length; a rank holding fewer rows gets CP padding (positions past the sequence) to reach ``L``.

Both are planned from the documents' intervals, never from per-token tensors: the work of the positions before
any edge is closed-form (:class:`CumulativeWork`, ``n (n + 1) / 2`` for a document's first ``n`` positions), the
allowed boundaries are the complement of the documents' interiors (:func:`doc_interiors`), and a layout is a few
runs of positions per rank (:class:`~blockdiag_dist.shard_plan.ShardPlan`). ``balanced_positions`` /
``snapped_positions`` take a per-position ``work [S]`` tensor and return token-level positions (tests, tools);
``balanced_runs`` / ``snapped_runs`` are what a step's planning uses, with the same choices.

``layout="auto"`` (:func:`choose_layout`) models the step cost of contiguous, balanced and snapped sharding
from the doc ids alone (so every rank picks the same) and takes the cheapest: the slowest rank's attention
work plus its received K/V tokens and its cut pieces, each priced in attention (query, key) pairs.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch
from torch import Tensor

from blockdiag_ref import DocLayout

__all__ = [
    "SNAP_TARGET", "TARGET", "CumulativeWork", "balanced_positions", "balanced_runs", "doc_boundaries",
    "doc_interiors", "interval_ranges", "position_work", "rows_outside", "snapped_positions", "snapped_runs",
]

TARGET = 1.02  # max/mean attention work accepted before trying finer chunks
SNAP_TARGET = 1.05  # max/mean work (and rows) a snapped layout may reach
SNAP_TOLERANCES = (1 / 2, 1 / 4, 1 / 8, 1 / 16)  # how far a boundary may move, in chunk lengths, tried in turn
CHUNKS_PER_RANK = (2, 4, 8, 16, 32)
_MAX_SWAPS = 200


def position_work(layout: DocLayout) -> Tensor:
    """float64 ``[S]``: keys seen by the query at each position, summed over rows (0 on padding). Token-level:
    for tests and tools; the planning uses :class:`CumulativeWork`."""
    pos = torch.arange(layout.seq_len)
    keys = torch.where(layout.segment_ids != 0, pos - layout.doc_starts + 1, 0)
    return keys.sum(0).to(torch.float64)


class CumulativeWork:
    """The attention work of the positions before an edge, summed over rows, from the documents' intervals.

    A document ``[s, e)`` gives its ``n``-th position ``n`` keys, so its positions before ``x`` carry
    ``g(clamp(x, s, e) - s)`` with ``g(n) = n (n + 1) / 2``. With the documents' full works summed in document
    order, one ``searchsorted`` per edge finds the documents wholly before it and the one it cuts: ``O(N + E
    log N)`` for ``E`` edges, never a per-token tensor. Equal to ``cumsum(position_work(layout))`` at every edge.

    >>> layout = DocLayout.from_seqlens([3, 2], pad=1)
    >>> CumulativeWork(layout).at(torch.tensor([0, 2, 3, 4, 6])).tolist()
    [0.0, 3.0, 6.0, 7.0, 9.0]
    """

    def __init__(self, layout: DocLayout) -> None:
        self.seq_len, self.batch_size = layout.seq_len, layout.batch_size
        seg = layout.segments.numpy()  # numpy on the host: a search runs per candidate edge set, many per step
        row, start, end = seg[:, 0], seg[:, 1], seg[:, 2]
        self._start = row * self.seq_len + start  # flat, ascending (documents are row-major)
        self._end = row * self.seq_len + end
        n = end - start
        self._before = np.concatenate([[0], np.cumsum(n * (n + 1) // 2)]).astype(np.int64)  # [N + 1]
        self._rows = np.arange(self.batch_size, dtype=np.int64)[:, None] * self.seq_len
        self._row_base = self._flat(self._rows)  # [B, 1]: the work of the rows before each row (0 for row 0)

    def _flat(self, y: np.ndarray) -> np.ndarray:
        """int64 work of the flat positions before ``y`` (rows flattened)."""
        k = _search(self._end, y, "right")  # documents ending at or before y
        total = self._before[k]
        if self._start.size:
            cut = k < self._start.size
            n = np.maximum(y - self._start[np.minimum(k, self._start.size - 1)], 0) * cut
            total = total + n * (n + 1) // 2
        return total

    def at(self, edges: Tensor) -> Tensor:
        """float64 ``[E]``: the work of positions ``< edges`` (edges past ``S`` count as ``S``)."""
        return torch.from_numpy(self.before(edges.numpy()))

    def before(self, edges: np.ndarray) -> np.ndarray:
        """:meth:`at` on a numpy array (what the searches call: no tensor between their numpy steps)."""
        x = np.clip(edges.astype(np.int64, copy=False), 0, self.seq_len)
        if self.batch_size == 1:  # the rows before row 0 carry no work
            return self._flat(x).astype(np.float64)
        return (self._flat(self._rows + x[None]) - self._row_base).sum(0).astype(np.float64)

    def per_rank(self, runs: Tensor, world: int) -> np.ndarray:
        """float64 ``[world]``: the work of each rank's positions, from shard runs ``[R, 4]`` (rank, start,
        length, local start): equal to ``StepPlan.work_per_rank()`` (the pairs of the rank's real queries)."""
        r = runs.numpy()
        ends = self.before(np.concatenate([r[:, 1], r[:, 1] + r[:, 2]]))
        return np.bincount(r[:, 0], weights=ends[r.shape[0]:] - ends[:r.shape[0]], minlength=world)

    def equal_chunks(self, chunks: int, chunk_len: int) -> np.ndarray:
        """float64: the work of ``chunks`` consecutive chunks of ``chunk_len`` positions from 0."""
        return np.diff(self.before(np.arange(chunks + 1, dtype=np.int64) * chunk_len))


def _search(a: np.ndarray, keys: np.ndarray, side: str = "left") -> np.ndarray:
    """``a.searchsorted(keys, side)``, the keys searched in ascending order: a search in sorted keys starts near
    the last one and runs several times faster than one in scattered keys (shard runs come by rank, not by
    position), more than what sorting them costs once there are thousands."""
    flat = keys.reshape(-1)
    if flat.size < 1024 or (flat[1:] >= flat[:-1]).all():
        return a.searchsorted(keys, side=side)
    order = flat.argsort()
    out = np.empty(flat.size, dtype=np.int64)
    out[order] = a.searchsorted(flat[order], side=side)
    return out.reshape(keys.shape)


class _TensorWork:
    """Per-position ``work [S]`` behind the interface of :class:`CumulativeWork` (sums as the tensor gives them)."""

    def __init__(self, work: Tensor) -> None:
        self.work, self.seq_len = work, work.numel()
        self._cum = None

    def at(self, edges: Tensor) -> Tensor:
        if self._cum is None:
            self._cum = torch.nn.functional.pad(torch.cumsum(self.work, 0), (1, 0))
        return self._cum[edges.clamp(0, self.seq_len)]

    def before(self, edges: np.ndarray) -> np.ndarray:
        return self.at(torch.from_numpy(edges)).numpy()

    def equal_chunks(self, chunks: int, chunk_len: int) -> np.ndarray:
        padded = torch.nn.functional.pad(self.work, (0, chunks * chunk_len - self.seq_len))
        return padded.view(chunks, chunk_len).sum(1).to(torch.float64).numpy()


def _assign(chunk_work: list[float], world: int, per_rank: int) -> tuple[list[list[int]], list[float]]:
    """Chunks to ranks, exactly ``per_rank`` each, minimising the largest summed work (LPT, then swaps).

    LPT: chunks by decreasing work (ties: lower index first), each to the least loaded rank with room (ties: the
    lowest rank), i.e. the smallest ``(load, rank)``. Swaps: between the most loaded rank (ties: the lowest) and
    the least loaded (ties: the lowest), the pair of chunks that lowers the larger of the two loads the most
    (ties: the first pair in their owned order), while one does.

    The LPT runs in rounds (:func:`_lpt`): the same choices as one chunk at a time from a heap of
    ``(load, rank)``, without a Python step per chunk where whole rounds can be decided at once."""
    owned, loads = _assign_array(np.asarray(chunk_work, dtype=np.float64), world, per_rank)
    return owned.tolist(), loads.tolist()


def _assign_array(w: np.ndarray, world: int, per_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_assign` on arrays: ``(owned [world, per_rank] in owned order, loads [world])``."""
    owned, loads = _lpt(w, world, per_rank)
    _swaps(w[owned], owned, loads, per_rank)
    return owned, loads


def _swaps(owned_w: np.ndarray, owned: np.ndarray, loads: np.ndarray, per_rank: int) -> None:
    """The swaps of :func:`_assign`, in place: ``owned_w`` is the chunks' work, kept beside ``owned``.

    A swap step takes the most and the least loaded ranks and the pair of their chunks that lowers the larger
    load the most; the first step with no such pair ends the search. After a few plain steps, steps are decided
    ``k`` at a time: the ``k`` most loaded ranks (by ``(-load, rank)``) are paired with the ``k`` least loaded (by
    ``(load, rank)``), and each pair's best swap is computed from the loads before any of them. Step ``j`` is the
    plain step as long as every load the steps before it changed lies strictly between its pair's loads: then its
    pair is still the most and the least loaded, with the same chunks and loads (a rank met twice fails this
    test). The steps up to the first one that is not are taken. ``k`` doubles while whole batches hold; where a
    batch holds for one step only (loads far apart), a few plain steps follow. Every choice and every load is the
    plain steps' exactly (tests: ``test_interval_plans``)."""
    world = loads.size
    done, k, plain = 0, 2, _PLAIN_SWAPS
    while done < _MAX_SWAPS:
        if plain or world < 4:  # the plain step
            hi, lo = int(loads.argmax()), int(loads.argmin())
            l_hi, l_lo = loads[hi], loads[lo]
            d = owned_w[hi][:, None] - owned_w[lo]
            new_max = _after_swap(l_hi, l_lo, d)
            i = int(new_max.argmin())  # the first best pair, row-major over (owned[hi], owned[lo])
            if new_max.flat[i] >= l_hi:
                return
            ia, ib = divmod(i, per_rank)
            dd = d[ia, ib]
            owned[hi, ia], owned[lo, ib] = owned[lo, ib], owned[hi, ia]
            owned_w[hi, ia], owned_w[lo, ib] = owned_w[lo, ib], owned_w[hi, ia]
            loads[hi] = l_hi - dd
            loads[lo] = l_lo + dd
            done, plain = done + 1, max(plain - 1, 0)
            continue
        k = min(k, world // 2, _MAX_SWAPS - done)
        top, bot = (-loads).argsort(kind="stable")[:k], loads.argsort(kind="stable")[:k]
        l_hi, l_lo = loads[top], loads[bot]
        d = owned_w[top][:, :, None] - owned_w[bot][:, None, :]  # [k, per_rank, per_rank]
        flat = _after_swap(l_hi[:, None, None], l_lo[:, None, None], d).reshape(k, -1)
        i = flat.argmin(1)
        rows = np.arange(k)
        dd = d.reshape(k, -1)[rows, i]
        new_hi, new_lo = l_hi - dd, l_lo + dd
        held = np.empty(k, dtype=bool)
        held[0] = True
        np.logical_and(np.maximum.accumulate(np.maximum(new_hi, new_lo))[:-1] < l_hi[1:],
                       np.minimum.accumulate(np.minimum(new_hi, new_lo))[:-1] > l_lo[1:], out=held[1:])
        m = k if held.all() else int(held.argmin())
        lowers = flat[rows[:m], i[:m]] < l_hi[:m]
        stop = not lowers.all()
        if stop:
            m = int(lowers.argmin())
        t, b = top[:m], bot[:m]
        ia, ib = np.divmod(i[:m], per_rank)
        owned[t, ia], owned[b, ib] = owned[b, ib], owned[t, ia]
        owned_w[t, ia], owned_w[b, ib] = owned_w[b, ib], owned_w[t, ia]
        loads[t] = new_hi[:m]
        loads[b] = new_lo[:m]
        done += m
        if stop:
            return
        if m == k:
            k *= 2
        elif m > 1:
            k = m
        else:
            k, plain = 2, _PLAIN_SWAPS


def _after_swap(l_hi, l_lo, d: np.ndarray) -> np.ndarray:
    """The larger of the two loads after each swap of work difference ``d`` between a rank of load ``l_hi`` and
    one of ``l_lo`` (scalars, or ``[k, 1, 1]`` beside ``d [k, p, p]``); inf where a swap would not narrow the gap
    (``d <= 0`` or ``d >= gap``): then no swap is taken (``inf >= l_hi``). One rule for the plain and the batched
    steps, so that both compute the same floats."""
    new_max = np.maximum(l_hi - d, l_lo + d)
    new_max[(d <= 0) | (d >= l_hi - l_lo)] = np.inf
    return new_max


_PLAIN_SWAPS = 4  # plain swap steps before the first batch, and after a batch that held for one step only


_LPT_MIN_ROUND = 16  # a round deciding fewer chunks than this hands the next ``world`` chunks to the heap, and
# fewer ranks with room than this hand all the rest


def _lpt(w: np.ndarray, world: int, per_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The LPT part of :func:`_assign`: ``(chunks of each rank in the order they came [world, per_rank], loads)``.

    Each chunk (by decreasing work, ties: lower index) goes to the smallest ``(load, rank)`` among the ranks with
    room. A *round* decides many chunks at once: with the ranks with room sorted by ``(load, rank)`` as
    ``r_0, r_1, ...`` and the next chunks ``k_0, k_1, ...``, chunk ``k_j`` goes to ``r_j`` as long as ``r_j``'s
    load is below every ``load(r_i) + work(k_i)`` (``i < j``, ``r_i`` not full): then no rank served earlier in
    the round has become the smaller one. Where rounds decide little (loads far apart), a heap takes the next
    ``world`` chunks one by one, and it hands out all the rest once fewer than ``_LPT_MIN_ROUND`` ranks have
    room (then every round would be small). Either way every choice is the one-at-a-time choice and every load is
    summed in the same order, so the result equals a heap's exactly (tests: ``test_interval_plans``)."""
    order = np.argsort(-w, kind="stable")  # timsort: fast on the runs that chunks inside long documents make
    ws = w[order]  # the chunks' work in the order they are handed out
    n_chunks = order.size
    loads = np.zeros(world, dtype=np.float64)
    count = np.zeros(world, dtype=np.int64)
    rank_of = np.empty(n_chunks, dtype=np.int64)  # the rank of the i-th chunk handed out
    room = np.arange(world)  # the ranks with room, ascending
    near_full = per_rank <= 1  # whether a rank with room lacks one chunk only (until then no rank fills up)
    i = 0
    while i < n_chunks:  # (array methods: numpy's functions add a Python wrapper of microseconds to each call)
        stop = n_chunks  # the last few ranks with room: the heap hands out the rest
        if room.size >= _LPT_MIN_ROUND:
            room_loads = loads[room]
            by_load = room_loads.argsort(kind="stable")  # by (load, rank): room is ascending
            m0 = min(room.size, n_chunks - i)
            by_load = by_load[:m0]
            ranks, before = room[by_load], room_loads[by_load]
            new = before + ws[i:i + m0]
            # a rank this chunk fills leaves the race
            served = np.where(count[ranks] + 1 >= per_rank, np.inf, new) if near_full else new
            ok = before[1:] < np.minimum.accumulate(served)[:-1]
            m = m0 if ok.all() else int(ok.argmin()) + 1
            if m >= min(_LPT_MIN_ROUND, m0):
                ranks = ranks[:m]
                loads[ranks] = new[:m]
                count[ranks] += 1
                rank_of[i:i + m] = ranks
                i += m
                if near_full:
                    room = (count < per_rank).nonzero()[0]
                else:
                    near_full = int(count.max()) + 1 >= per_rank
                continue
            stop = min(n_chunks, i + world)  # the round decided little: the heap takes the next `world` chunks
        # one at a time from a heap
        heap = [(float(loads[r]), int(r)) for r in room]
        heapq.heapify(heap)
        cnt = count.tolist()
        wl = ws[i:stop].tolist()
        for k in range(stop - i):
            load, r = heap[0]
            rank_of[i] = r
            cnt[r] += 1
            if cnt[r] < per_rank:
                heapq.heapreplace(heap, (load + wl[k], r))
            else:
                heapq.heappop(heap)
            loads[r] = load + wl[k]
            i += 1
        count = np.asarray(cnt, dtype=np.int64)
        room = (count < per_rank).nonzero()[0]
        near_full = bool(room.size) and int(count[room].max()) + 1 >= per_rank
    # chunks grouped by rank, each rank's in the order they came: a stable sort of small integers, which numpy
    # sorts by radix (linear) in 16 bits and by merging in 64
    keys = rank_of.astype(np.int16) if world <= np.iinfo(np.int16).max else rank_of
    by_rank = np.argsort(keys, kind="stable")
    return order[by_rank].reshape(world, per_rank), loads  # every rank ends with exactly per_rank chunks


def _hopeless(chunk_work: np.ndarray, world: int, limit: float) -> bool:
    """Whether no assignment can reach max/mean work ``<= limit``: the largest chunk alone exceeds it (with a
    margin far above rounding, so a layout this rejects would have been rejected by its assignment too)."""
    mean = float(chunk_work.sum()) / world
    return mean > 0 and float(chunk_work.max()) > limit * mean * (1 + 1e-9)


def _heaviest_rank_floor(x: np.ndarray, per_rank: int) -> float:
    """A lower bound of the largest per-rank sum of ``x`` over every assignment of exactly ``per_rank`` chunks
    to each rank: the rank holding the largest chunk holds ``per_rank - 1`` others, at least the smallest ones.

    >>> _heaviest_rank_floor(np.array([5.0, 1.0, 2.0, 9.0]), 2)  # 9 must share a rank with one of the others
    10.0
    """
    if per_rank == 1:
        return float(x.max())
    # the smallest per_rank - 1 of the others sum to the smallest per_rank - 1 of all chunks: where those hold the
    # largest chunk, every chunk from the (per_rank - 1)-th smallest up equals it, so the others hold its value too
    return float(x.max()) + float(np.partition(x, per_rank - 2)[:per_rank - 1].sum())


def runs_of(intervals: list[list[tuple[int, int]]]) -> Tensor:
    """Shard runs ``[R, 4]`` (rank, start, length, local_start) from each rank's ``(start, length)`` intervals in
    local order, adjacent ones merged (a run is maximal)."""
    counts = np.array([len(ivs) for ivs in intervals], dtype=np.int64)
    rank = np.repeat(np.arange(len(intervals)), counts)
    flat = np.array([iv for ivs in intervals for iv in ivs], dtype=np.int64).reshape(-1, 2)
    return _runs(rank, flat[:, 0], flat[:, 1])


def _runs(rank: np.ndarray, start: np.ndarray, length: np.ndarray) -> Tensor:
    """:func:`runs_of` from flat arrays: interval ``i`` of rank ``rank[i]`` (nondecreasing), in local order."""
    first = np.ones(len(rank), dtype=bool)
    first[1:] = rank[1:] != rank[:-1]
    before = np.cumsum(length) - length  # rows before each interval, all ranks
    local = before - np.maximum.accumulate(np.where(first, before, 0))  # ... on its own rank
    new = first.copy()
    new[1:] |= start[1:] != start[:-1] + length[:-1]
    group = np.cumsum(new) - 1
    merged = np.zeros(int(new.sum()), dtype=np.int64)
    np.add.at(merged, group, length)
    return torch.from_numpy(np.stack([rank[new], start[new], merged, local[new]], 1).reshape(-1, 4))


def _chunk_runs(owned: np.ndarray, chunk_start: np.ndarray, chunk_len: np.ndarray, L: int, padded_len: int) -> Tensor:
    """Shard runs of chunks: rank ``r`` holds chunks ``owned[r]`` (ascending) in order, then, when it holds fewer
    than ``L`` rows, CP padding: positions from ``padded_len`` on, handed out in rank order."""
    world, per_rank = owned.shape
    rows = chunk_len[owned].sum(1)
    pad = L - rows
    pad_start = padded_len + np.cumsum(pad) - pad
    start = np.concatenate([chunk_start[owned], pad_start[:, None]], 1).reshape(-1)
    length = np.concatenate([chunk_len[owned], pad[:, None]], 1).reshape(-1)
    rank = np.repeat(np.arange(world), per_rank + 1)
    keep = length > 0
    return _runs(rank[keep], start[keep], length[keep])


def interval_ranges(starts: Tensor, lengths: Tensor, total: int | None = None) -> Tensor:
    """Concatenation of ``arange(s, s + n)`` for each ``(s, n)``: intervals to the tokens they hold. On a device,
    ``total`` (the sum of ``lengths``, when the caller knows it) spares reading the sum back to the host.

    >>> interval_ranges(torch.tensor([5, 0]), torch.tensor([2, 3])).tolist()
    [5, 6, 0, 1, 2]
    """
    if starts.device.type != "cpu" or lengths.device.type != "cpu":
        return torch_ranges(starts, lengths, total)
    # numpy on the host: a few calls of a microsecond each where torch's cost tens (plans are many small calls)
    out = ragged_ranges(starts.numpy().astype(np.int64, copy=False), lengths.numpy().astype(np.int64, copy=False))
    if total is not None and out.size != total:  # what a device would trust unchecked is checked here
        raise ValueError(f"interval_ranges: expected total = sum(lengths) = {out.size}, got total={total}")
    return torch.from_numpy(out)


def torch_ranges(starts: Tensor, lengths: Tensor, total: int | None = None) -> Tensor:
    """:func:`interval_ranges` in torch ops, on the inputs' device (two kernels and no read-back given ``total``)."""
    if total is None:
        total = int(lengths.sum()) if lengths.numel() else 0
    shift = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths, output_size=total)
    return torch.arange(total, device=starts.device) + shift


def rows_outside(start: Tensor, length: Tensor, num_rows: int, device: torch.device | str) -> Tensor:
    """int64, ascending: the rows of ``[0, num_rows)`` in no interval ``[start, start + length)`` (disjoint), from
    the gaps between the intervals, expanded on ``device`` (the varlen kernel's padding rows, a rank's padding).

    >>> rows_outside(torch.tensor([4, 0]), torch.tensor([2, 1]), 8, "cpu").tolist()
    [1, 2, 3, 6, 7]
    """
    order = torch.argsort(start)
    start, end = start[order], (start + length)[order]
    gap_start = torch.cat([start.new_zeros(1), end])
    gap_len = torch.cat([start, start.new_full((1,), num_rows)]) - gap_start
    return interval_ranges(gap_start.to(device), gap_len.to(device), total=num_rows - int(length.sum()))


def ragged_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """:func:`interval_ranges` on int64 arrays."""
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if lengths.size else 0
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)


def overlaps(lo: np.ndarray, hi: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every overlapping pair of intervals ``[lo, hi)`` (any order) and ``[starts, ends)`` (sorted, disjoint), int64
    arrays: ``(i, j, a, b)``, interval ``i`` meeting interval ``j`` on ``[a, b)``, ordered by ``i`` then ``j``. Two
    ``searchsorted`` and one ragged expansion: ``O((I + J) log J + pairs)``, never a per-position array.

    >>> [x.tolist() for x in overlaps(np.array([2, 0]), np.array([9, 3]), np.array([0, 5]), np.array([4, 7]))]
    [[0, 0, 1], [0, 1, 0], [2, 5, 0], [4, 7, 3]]
    """
    j0 = np.searchsorted(ends, lo, side="right")  # the first ending after lo
    n = np.maximum(np.searchsorted(starts, hi) - j0, 0)  # ... up to the last starting before hi
    i = np.repeat(np.arange(n.size, dtype=np.int64), n)
    j = ragged_ranges(j0, n)
    return i, j, np.maximum(lo[i], starts[j]), np.minimum(hi[i], ends[j])


def _positions_of(runs: Tensor, world: int, local_len: int) -> Tensor:
    return interval_ranges(runs[:, 1], runs[:, 2]).view(world, local_len)


def _balanced(work, world: int) -> tuple[int, int, np.ndarray, float]:
    """``(local_len, chunk_len, chunks owned per rank [world, per_rank] ascending, max/mean work)``.

    The chunk counts are tried coarsest first; the first whose assignment reaches ``TARGET`` wins, else the one of
    least max/mean work. A count whose :func:`_heaviest_rank_floor` already exceeds ``TARGET`` cannot end the
    search: it waits for the next count's assignment, and where that one's max/mean is below the floor (with a
    margin far above rounding) it can neither win nor change the winner, and its own assignment is skipped. The
    choice is the one of trying every count in turn (tests: ``test_interval_plans``)."""
    S = work.seq_len
    sizes = []  # (per_rank, local_len, chunk_len), coarsest first
    for per_rank in CHUNKS_PER_RANK:
        chunks = per_rank * world
        if sizes and chunks > S:
            break  # chunks of less than one real token only add padding
        local_len = per_rank * -(-S // chunks)
        sizes.append((per_rank, local_len, local_len // per_rank))
    best = None

    def consider(per_rank, local_len, chunk_len, chunk_work, assigned=None):
        nonlocal best
        if best is not None and _hopeless(chunk_work, world, best[0] - 1e-12):
            return  # cannot beat the best so far, which did not reach TARGET either
        imbalance, owned = assigned or _imbalance(chunk_work, world, per_rank)
        if best is None or imbalance < best[0] - 1e-12:
            best = (imbalance, local_len, chunk_len, np.sort(owned, 1))

    waiting = []  # counts that cannot reach TARGET, waiting for the next count's max/mean
    for j, (per_rank, local_len, chunk_len) in enumerate(sizes):
        chunk_work = work.equal_chunks(per_rank * world, chunk_len)
        floor = _floor_ratio(chunk_work, world, per_rank)
        if floor > TARGET * (1 + 1e-9) and j + 1 < len(sizes):
            waiting.append((per_rank, local_len, chunk_len, chunk_work, floor))
            continue
        assigned = _imbalance(chunk_work, world, per_rank)
        for w_per_rank, w_local_len, w_chunk_len, w_chunk_work, w_floor in waiting:
            if w_floor <= assigned[0] * (1 + 1e-9) + 1e-12:  # not beaten for sure: tried in its turn
                consider(w_per_rank, w_local_len, w_chunk_len, w_chunk_work)
        waiting.clear()
        consider(per_rank, local_len, chunk_len, chunk_work, assigned)
        if best[0] <= TARGET:
            break
    imbalance, local_len, chunk_len, owned = best
    return local_len, chunk_len, owned, imbalance


def _imbalance(chunk_work: np.ndarray, world: int, per_rank: int) -> tuple[float, np.ndarray]:
    """``(max/mean work, owned)`` of the assignment of ``chunk_work`` (1 where there is no work)."""
    owned, loads = _assign_array(chunk_work, world, per_rank)
    load = loads.tolist()
    mean = sum(load) / world
    return (max(load) / mean if mean > 0 else 1.0), owned


def _floor_ratio(chunk_work: np.ndarray, world: int, per_rank: int) -> float:
    """:func:`_heaviest_rank_floor` over the mean work per rank (1 where there is no work)."""
    mean = float(chunk_work.sum()) / world
    return _heaviest_rank_floor(chunk_work, per_rank) / mean if mean > 0 else 1.0


def _equal_chunk_runs(owned: np.ndarray, chunk_len: int, local_len: int) -> Tensor:
    n = owned.size
    return _chunk_runs(owned, np.arange(n, dtype=np.int64) * chunk_len, np.full(n, chunk_len, dtype=np.int64),
                       local_len, 0)


def balanced_runs(work: CumulativeWork, world: int) -> tuple[int, Tensor, float]:
    """``(local_len, runs [R, 4], max/mean work)``: :func:`balanced_positions` as shard runs, from the documents'
    intervals (see :class:`~blockdiag_dist.shard_plan.ShardPlan`)."""
    S = work.seq_len
    if world == 1:
        return S, torch.tensor([[0, 0, S, 0]]), 1.0
    local_len, chunk_len, owned, imbalance = _balanced(work, world)
    return local_len, _equal_chunk_runs(owned, chunk_len, local_len), imbalance


def balanced_positions(work: Tensor, world: int) -> tuple[int, Tensor, float]:
    """``(local_len, positions [W, L], max/mean work)`` for per-position ``work [S]``.

    >>> L, pos, imbalance = balanced_positions(torch.arange(1.0, 9.0), 2)  # one document of 8 tokens
    >>> L, pos.tolist(), imbalance
    (4, [[0, 1, 6, 7], [2, 3, 4, 5]], 1.0)
    """
    S = work.numel()
    if world == 1:  # one rank holds everything: nothing to balance, no padding to add
        return S, torch.arange(S)[None], 1.0
    local_len, chunk_len, owned, imbalance = _balanced(_TensorWork(work), world)
    runs = _equal_chunk_runs(owned, chunk_len, local_len)
    return local_len, _positions_of(runs, world, local_len), imbalance


def doc_boundaries(layout: DocLayout) -> Tensor:
    """bool ``[S + 1]``: whether a chunk may start at position ``p`` without cutting a document in any row
    (every row starts a document there, or is padding on either side; ``0`` and ``S`` always). Token-level: for
    tests and tools; the planning uses :func:`doc_interiors`."""
    ids = layout.segment_ids
    prev = torch.nn.functional.pad(ids[:, :-1], (1, 0))
    ok = (ids != prev) | (ids == 0)
    return torch.cat([ok.all(0), torch.tensor([True])])


def doc_interiors(layout: DocLayout) -> tuple[Tensor, Tensor]:
    """``(starts, ends)`` int64: the positions where a chunk may *not* start, as sorted disjoint intervals
    ``[a, b)``: the union over all rows of every document's interior ``[start + 1, end)``. The complement of
    :func:`doc_boundaries`; ``a - 1`` and ``b`` are always allowed.

    >>> doc_interiors(DocLayout.from_seqlens([[3, 2], [4, 1]]))  # row 0: [1, 3) and [4, 5); row 1: [1, 4)
    (tensor([1]), tensor([5]))
    """
    seg = layout.segments.numpy()
    a, b = seg[:, 1] + 1, seg[:, 2]
    keep = a < b
    a, b = a[keep], b[keep]
    if a.size and layout.batch_size > 1:  # one row's documents come in order; rows interleave
        order = np.argsort(a, kind="stable")
        a, b = a[order], b[order]
    # touching intervals merge (the position between them is interior to both): a new one starts past the
    # furthest end so far
    new = np.ones(a.size, dtype=bool)
    new[1:] = a[1:] > np.maximum.accumulate(b)[:-1]
    first = np.flatnonzero(new)
    ends = np.maximum.reduceat(b, first) if a.size else b
    return torch.from_numpy(a[first]), torch.from_numpy(ends)


class _Allowed:
    """Where chunk boundaries may go: everything but the documents' interiors (intervals, or a bool tensor)."""

    def __init__(self, bounds: Tensor | None = None, interiors: tuple[Tensor, Tensor] | None = None) -> None:
        if interiors is None:  # from doc_boundaries' bool [S + 1]: its runs of False are the interiors
            bad = torch.nn.functional.pad((~bounds).to(torch.int8), (1, 1))
            d = torch.diff(bad)
            interiors = ((d == 1).nonzero().flatten(), (d == -1).nonzero().flatten())
        self.starts, self.ends = interiors[0].numpy(), interiors[1].numpy()

    def nearest(self, x: Tensor | np.ndarray) -> np.ndarray:
        """int64: the allowed position nearest to each ``x`` (ties: the lower one). numpy on the host: the snapped
        search asks once per chunk count, a few torch calls' worth of overhead each."""
        xs = np.asarray(x, dtype=np.int64)
        if self.starts.size == 0:
            return xs
        j = np.maximum(self.starts.searchsorted(xs, side="right") - 1, 0)
        a, b = self.starts[j] - 1, self.ends[j]
        inside = (xs > a) & (xs < b)
        return np.where(inside, np.where(xs - a <= b - xs, a, b), xs)


def _snap(edges: Tensor | np.ndarray, allowed: _Allowed, reach: int, S: int,
          nearest: np.ndarray | None = None) -> np.ndarray:
    """Move each interior edge below ``S`` to the nearest allowed boundary within ``reach`` (kept strictly
    increasing: an edge that would not pass the one before keeps its place, or moves one past it). ``nearest``:
    ``allowed.nearest`` of the interior edges, when the caller has it (one search for every ``reach``).

    The rule is sequential (each edge depends on the one before), but an edge whose candidate passes the edge
    before it lands on its candidate, and from there on the edges follow their candidates until one does not pass
    the one before: only the stretches that start at such an edge, up to the first edge back on its candidate,
    are walked one by one (the order-preserving case, the common one, walks none). numpy inside: the search
    calls this up to 20 times per step."""
    xs = np.asarray(edges, dtype=np.int64)
    x = xs[1:-1]
    best = allowed.nearest(x) if nearest is None else nearest
    cand = np.where((x < S) & (np.abs(best - x) <= reach), best, x)
    out = np.concatenate([xs[:1], cand, xs[-1:]])
    if (out[1:] > out[:-1]).all():  # every move keeps the order: the sequential rule changes nothing
        return out
    n = out.size - 1  # out[n], the last edge, stays
    bad = np.flatnonzero(out[1:n] <= out[:n - 1]) + 1  # interior edges whose candidate does not pass the one before
    j = 0
    for i in bad.tolist():
        if i < j:
            continue  # inside a stretch already walked
        prev = int(out[i - 1])
        while i < n:
            c = int(out[i])  # still the candidate: the walk only writes behind itself
            if c > prev:  # back on its candidate: the rest follows the candidates up to the next bad edge
                break
            prev = max(int(xs[i]), prev + 1)
            out[i] = prev
            i += 1
        j = i
    return out


def _snapped(work, world: int, allowed: _Allowed) -> tuple[int, Tensor, float] | None:
    """``(L, shard runs [R, 4], max/mean work)`` or None (see :func:`snapped_positions`)."""
    S = work.seq_len
    if world == 1:
        return None
    tried: set[tuple[int, ...]] = set()
    for per_rank in CHUNKS_PER_RANK:
        chunks = per_rank * world
        if chunks > S:
            break
        local_len = per_rank * -(-S // chunks)
        chunk_len = local_len // per_rank
        padded_len = world * local_len
        edges = np.arange(chunks + 1, dtype=np.int64) * chunk_len
        inner_edges = edges[1:-1]
        inner_nearest = allowed.nearest(inner_edges)  # the same search for every tolerance
        # the work before every edge a tolerance can produce without a walk: the unsnapped edges and their
        # nearest boundaries (``work.before`` is elementwise, so picking from these equals computing it anew)
        at_edges, at_nearest = work.before(edges), work.before(inner_nearest)
        for tolerance in SNAP_TOLERANCES:
            e = _snap(edges, allowed, int(tolerance * chunk_len), S, inner_nearest)
            key = (per_rank, e.tobytes())
            if key in tried:  # the same edges as a tolerance already tried: the same outcome
                continue
            tried.add(key)
            inner = e[1:-1]
            on_nearest = inner == inner_nearest
            if np.all(on_nearest | (inner == inner_edges)):
                at = np.concatenate([at_edges[:1], np.where(on_nearest, at_nearest, at_edges[1:-1]), at_edges[-1:]])
            else:  # the walk placed some edges elsewhere
                at = work.before(e)
            chunk_work = np.diff(at)
            lens = np.diff(e)
            # the rank holding the largest chunk, with the smallest beside it, already breaks the row or the work
            # target (margin as _hopeless): so would the assignment
            if (_heaviest_rank_floor(lens, per_rank) > SNAP_TARGET * local_len
                    or _floor_ratio(chunk_work, world, per_rank) > SNAP_TARGET * (1 + 1e-9)):
                continue
            imbalance, owned = _imbalance(chunk_work, world, per_rank)
            rows = lens[owned].sum(1).tolist()  # every rank owns exactly per_rank chunks
            if imbalance <= SNAP_TARGET and max(rows) <= SNAP_TARGET * local_len:
                L = max(rows)
                return L, _chunk_runs(np.sort(owned, 1), e[:-1], lens, L, padded_len), imbalance
    return None


def snapped_runs(work: CumulativeWork, world: int, interiors: tuple[Tensor, Tensor]) -> tuple[int, Tensor, float] | None:
    """:func:`snapped_positions` as shard runs, from the documents' intervals (``interiors``: :func:`doc_interiors`)."""
    return _snapped(work, world, _Allowed(interiors=interiors))


def snapped_positions(work: Tensor, world: int, bounds: Tensor) -> tuple[int, Tensor, float] | None:
    """Like :func:`balanced_positions`, with chunk boundaries snapped to ``bounds`` (see
    :func:`doc_boundaries`); ``None`` when no snapped layout keeps work and rows within ``SNAP_TARGET``.

    >>> layout = DocLayout.from_seqlens([3, 5, 4, 4])
    >>> L, pos, imbalance = snapped_positions(position_work(layout), 2, doc_boundaries(layout))
    >>> pos.tolist(), round(imbalance, 3)  # cut at 8, a document boundary (balanced cuts the 5-token document)
    ([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]], 1.024)
    """
    got = _snapped(_TensorWork(work), world, _Allowed(bounds=bounds))
    if got is None:
        return None
    L, runs, imbalance = got
    return L, _positions_of(runs, world, L), imbalance
