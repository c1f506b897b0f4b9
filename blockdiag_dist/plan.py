"""Pure plans for one training step: who holds which rows, and which keys each rank needs from the others.

Everything here is a pure function of replicated data (the full doc ids, the CP world size, the options):
no process group, no communication, and the same result on every rank. That is what makes the collectives
safe (every rank issues the same ones with the same sizes) and what lets the tests loop over ranks in one
process and compare with a brute-force computation from the reference mask.

Shape legend:
    B     batch rows                 S     sequence length given       Sp    padded length = W * L
    W     CP world size              L     rows held by one rank       Tq    local query tokens = B * L
    Tk    key tokens a rank holds after the exchange

A *flat id* names one token of the padded batch: ``flat = b * Sp + p`` for row ``b`` and global position ``p``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from .balance import CumulativeWork, _search, doc_interiors, overlaps, snapped_runs
from .docs import DocPlan, plan_documents
from .shard_plan import ShardPlan, interval_ranges, padded_doc_starts, padded_segments, plan_shards

__all__ = [
    "LAYOUT_COST",
    "ExchangePlan",
    "ShardPlan",
    "StepPlan",
    "choose_layout",
    "plan_exchange",
    "plan_shards",
    "plan_step",
]


class ExchangePlan:
    """Needed sets for one window: which keys each rank's real queries may see that live on other ranks.

    Stored as *ranges*: ``ranges`` int64 ``[K, 4]``, one row ``(dest, row, lo, hi)`` per range of keys
    ``[lo, hi)`` of batch row ``row`` that rank ``dest``'s queries may see, before their own pieces; ordered by
    destination, then flat id, disjoint. The needed set of ``dest`` is its ranges minus the positions it holds.
    Everything the planning asks (tokens each rank receives, whether a halo suffices) is closed-form over the
    ranges and the shard's runs (:meth:`ShardPlan.rows_before`); a rank's own transfers are the ranges cut at
    the runs for that rank only (:meth:`spans_to`, :meth:`spans_from`).

    *Spans* ``[K', 6]``: ``(dest, src, row, start, length, src_local)``, keys ``[start, start + length)`` of row
    ``row`` that ``dest`` needs from ``src``, held there from local row ``src_local`` on; ordered by destination
    then flat id. ``spans`` / ``counts[s, d]`` (tokens ``s`` sends ``d``) / ``flat_ids`` / ``dest`` / ``src`` cover
    every rank and are built when asked. Keys at padding positions are never needed.
    """

    def __init__(self, shards: ShardPlan, batch_size: int, window_left: int, ranges: Tensor) -> None:
        self.shards, self.batch_size, self.window_left = shards, batch_size, window_left
        self.ranges = ranges
        self._to: dict[int, Tensor] = {}  # spans_to / spans_from of the ranks asked for
        self._from: dict[int, Tensor] = {}

    @property
    def world(self) -> int:
        return self.shards.world

    @property
    def local_tokens(self) -> int:
        return self.batch_size * self.shards.local_len

    # ---- closed-form over the ranges -------------------------------------------------------------------
    @cached_property
    def _range_needed(self) -> np.ndarray:
        """int64 ``[K]``: keys of each range that its destination does not hold."""
        dest, _, lo, hi = self.ranges.numpy().T
        return hi - lo - (self.shards.rows_before(dest, hi) - self.shards.rows_before(dest, lo))

    def needed_tokens(self) -> list[int]:
        """Per rank: tokens received by a needed-only exchange (the minimum)."""
        return np.bincount(self.ranges[:, 0].numpy(), weights=self._range_needed, minlength=self.world).astype(np.int64).tolist()

    @cached_property
    def halo_ok(self) -> bool:
        """Every rank's needed keys lie on its left neighbour (so one point-to-point hop suffices)."""
        dest, _, lo, hi = self.ranges.numpy().T
        left = np.maximum(dest - 1, 0)
        on_left = np.where(dest > 0, self.shards.rows_before(left, hi) - self.shards.rows_before(left, lo), 0)
        return bool((self._range_needed == on_left).all())

    # ---- one rank's transfers -------------------------------------------------------------------------
    @cached_property
    def _dest_bounds(self) -> list[int]:
        return torch.searchsorted(self.ranges[:, 0].contiguous(), torch.arange(self.world + 1)).tolist()

    def spans_to(self, rank: int) -> Tensor:
        """The spans ``rank`` receives ``[K_r, 6]``, by flat id: its ranges cut at the shard's runs, its own
        positions dropped."""
        got = self._to.get(rank)
        if got is None:
            got = self._to.setdefault(rank, _cut(self.ranges[self._dest_bounds[rank]:self._dest_bounds[rank + 1]], self.shards))
        return got

    def spans_from(self, rank: int) -> Tensor:
        """The spans ``rank`` sends ``[K_s, 6]``, by destination then flat id: every other rank's ranges
        intersected with ``rank``'s runs."""
        got = self._from.get(rank)
        if got is None:
            got = self._from.setdefault(rank, self._spans_from(rank))
        return got

    def _spans_from(self, rank: int) -> Tensor:
        ranges = self.ranges.numpy()
        dest, row, lo, hi = ranges[ranges[:, 0] != rank].T
        runs = self.shards.rank_runs(rank).numpy()
        runs = runs[np.argsort(runs[:, 1], kind="stable")]
        k, run, a, b = overlaps(lo, hi, runs[:, 1], runs[:, 1] + runs[:, 2])
        return torch.from_numpy(np.stack([dest[k], np.full_like(a, rank), row[k], a, b - a, runs[run, 3] + a - runs[run, 1]], 1))

    def recv_counts(self, rank: int) -> list[int]:
        """Tokens ``rank`` receives from each rank (a needed-only exchange's receive splits)."""
        s = self.spans_to(rank)
        return torch.zeros(self.world, dtype=torch.int64).index_add_(0, s[:, 1], s[:, 4]).tolist()

    def send_counts(self, rank: int) -> list[int]:
        """Tokens ``rank`` sends to each rank (a needed-only exchange's send splits)."""
        s = self.spans_from(rank)
        return torch.zeros(self.world, dtype=torch.int64).index_add_(0, s[:, 0], s[:, 4]).tolist()

    def _flat_of(self, spans: Tensor) -> Tensor:
        return interval_ranges(spans[:, 2] * self.shards.padded_len + spans[:, 3], spans[:, 4])

    def recv_flat_ids(self, rank: int) -> Tensor:
        """Flat ids ``rank`` receives, in arrival order of a needed-only exchange: by source rank, then flat id."""
        mine = self.spans_to(rank)
        return self._flat_of(mine[torch.sort(mine[:, 1], stable=True).indices])

    def send_runs(self, rank: int, dest: int | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`send_rows` as runs ``(first local index, length)``, int64 ``[K_s]`` each (``O(spans)``)."""
        s = self.spans_from(rank)
        if dest is not None:
            s = s[s[:, 0] == dest]
        return s[:, 2] * self.shards.local_len + s[:, 5], s[:, 4]

    def send_rows(self, rank: int, dest: int | None = None) -> Tensor:
        """Local token indices (``b * L + l``) that ``rank`` sends, grouped by destination in rank order (or
        only those for ``dest``), each group in the order its destination expects (token-level)."""
        return interval_ranges(*self.send_runs(rank, dest))

    # ---- every rank (built when asked) ----------------------------------------------------------------
    @cached_property
    def spans(self) -> Tensor:
        """Every rank's spans ``[K', 6]``, by destination then flat id."""
        return _cut(self.ranges, self.shards)

    @cached_property
    def counts(self) -> Tensor:
        """int64 ``[W (source), W (destination)]``: tokens each rank sends each other rank."""
        W, s = self.world, self.spans
        return torch.zeros(W * W, dtype=torch.int64).index_add_(0, s[:, 1] * W + s[:, 0], s[:, 4]).view(W, W)

    @cached_property
    def flat_ids(self) -> Tensor:
        """int64 ``[N]``: every needed key's flat id, by destination then flat id (token-level)."""
        return self._flat_of(self.spans)

    @cached_property
    def dest(self) -> Tensor:
        return torch.repeat_interleave(self.spans[:, 0], self.spans[:, 4])

    @cached_property
    def src(self) -> Tensor:
        return torch.repeat_interleave(self.spans[:, 1], self.spans[:, 4])

    @cached_property
    def needed(self) -> tuple[Tensor, ...]:
        """Per rank: sorted flat ids of the tokens it needs from other ranks."""
        return tuple(self._flat_of(self.spans_to(r)) for r in range(self.world))

    def sent_tokens(self) -> list[int]:
        """Per rank: tokens sent by a needed-only exchange."""
        return self.counts.sum(1).tolist()

    def allgather_tokens(self) -> int:
        """Per rank: tokens received (and sent) by an all-gather."""
        return (self.world - 1) * self.local_tokens

    def fingerprint(self) -> bytes:
        h = hashlib.sha256()
        for t in (self.shards.runs, self.ranges):
            h.update(t.numpy().tobytes())
            h.update(b"|")
        h.update(f"{self.window_left}".encode())
        return h.digest()


def needed_ranges(docs: DocPlan, window_left: int) -> Tensor:
    """The ranges of keys each rank's queries may see before their own pieces, ``[K, 4]`` (see
    :class:`ExchangePlan`), from the pieces.

    A piece ``[s, e)`` of a document starting at ``d`` has real queries that see the keys ``[max(d, s - left), s)``
    before it (all of them: its first query sees every one). Per (rank, document) these ranges are merged
    (pieces in document order, each range starting no earlier than the one before). ``O(P log P)``.
    """
    sp = docs.shards.padded_len
    # numpy on the host: a dozen calls on a few hundred pieces, where each torch call costs tens of microseconds
    t = {name: docs.table[name].numpy() for name in ("rank", "doc", "row", "start", "doc_start")}
    lo = t["doc_start"] if window_left < 0 else np.maximum(t["doc_start"], t["start"] - window_left)
    hi = t["start"]
    keep = lo < hi
    rank, doc, row, lo, hi = t["rank"][keep], t["doc"][keep], t["row"][keep], lo[keep], hi[keep]
    order = np.argsort(rank * (docs.num_docs * sp) + doc * sp + hi, kind="stable")  # by rank, document, position
    rank, doc, row, lo, hi = rank[order], doc[order], row[order], lo[order], hi[order]
    if rank.size == 0:
        return torch.zeros(0, 4, dtype=torch.int64)
    new = np.ones(rank.size, dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (doc[1:] != doc[:-1]) | (lo[1:] > hi[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], rank.size) - 1
    ranges = np.stack([rank[first], row[first], lo[first], hi[last]], 1).astype(np.int64, copy=False)
    key = ranges[:, 0] * (docs.batch_size * sp) + ranges[:, 1] * sp + ranges[:, 2]
    return torch.from_numpy(np.ascontiguousarray(ranges[np.argsort(key, kind="stable")]))


def _cut(ranges: Tensor, shards: ShardPlan) -> Tensor:
    """Ranges ``[K, 4]`` cut at the shard's runs into spans ``[K', 6]``, the destination's own positions dropped
    (runs sorted by position tile ``[0, Sp)``); numpy (a dozen calls on a few hundred ranges)."""
    runs = shards.by_position.numpy()
    dest, row, lo, hi = ranges.numpy().T
    k, run, a, b = overlaps(lo, hi, runs[:, 1], runs[:, 1] + runs[:, 2])
    src = runs[run, 0]
    spans = np.stack([dest[k], src, row[k], a, b - a, runs[run, 3] + a - runs[run, 1]], 1)
    return torch.from_numpy(np.ascontiguousarray(spans[src != dest[k]]))


def plan_exchange(layout: DocLayout, shards: ShardPlan, window_left: int = -1, *, docs: DocPlan | None = None) -> ExchangePlan:
    """Needed sets of every rank (pure; identical on every rank), from the pieces (``docs``: the step's
    :class:`~blockdiag_dist.docs.DocPlan`, built here when not given)."""
    docs = plan_documents(layout, shards) if docs is None else docs
    return ExchangePlan(shards=shards, batch_size=layout.batch_size, window_left=window_left,
                        ranges=needed_ranges(docs, window_left))


@dataclass(frozen=True, eq=False)
class StepPlan:
    """The pure part of a step's state: the layout, the sharding, and (per window) the needed sets."""

    layout: DocLayout
    shards: ShardPlan
    _exchanges: dict[int, ExchangePlan] = field(default_factory=dict, repr=False)
    _chunked: dict[int, StepPlan] = field(default_factory=dict, repr=False)

    def chunked(self, chunk: int) -> StepPlan:
        """The plan of chunked local attention with chunks of ``chunk`` positions (``< 0``: this plan): the same
        shards over the layout whose documents are the chunks of each document, counted from its start
        (:meth:`~blockdiag_ref.DocLayout.chunked`). Its needed sets, segments and document starts are those of
        the chunks, so every exchange and kernel computes chunked attention unchanged. Built once per step."""
        if chunk < 0:
            return self
        plan = self._chunked.get(chunk)
        if plan is None:
            plan = self._chunked.setdefault(chunk, StepPlan(layout=self.layout.chunked(chunk), shards=self.shards))
        return plan

    @cached_property
    def segments(self) -> Tensor:
        """int64 ``[B * Sp]`` segment id per flat id (0 = padding; token-level, built when asked)."""
        return padded_segments(self.layout, self.shards).flatten()

    @cached_property
    def documents(self) -> DocPlan:
        """The step's documents and every rank's pieces of them (:class:`blockdiag_dist.docs.DocPlan`): the one
        source the exchange plans, the kernels' pieces, the work per rank and the layout's cost derive from."""
        return plan_documents(self.layout, self.shards)

    @cached_property
    def doc_starts(self) -> Tensor:
        """int64 ``[B * Sp]`` start position of the document of each flat id (-1 = padding; token-level)."""
        return padded_doc_starts(self.layout, self.shards).flatten()

    def exchange(self, window_left: int) -> ExchangePlan:
        """Needed sets for a window (computed once per window per step, then cached)."""
        plan = self._exchanges.get(window_left)
        if plan is None:
            plan = plan_exchange(self.layout, self.shards, window_left, docs=self.documents)
            plan = self._exchanges.setdefault(window_left, plan)
        return plan

    def local_flat_ids(self, rank: int) -> Tensor:
        """Flat ids of ``rank``'s local tokens, ``[B * L]`` in local order (row-major over ``[B, L]``)."""
        b = torch.arange(self.layout.batch_size)[:, None] * self.shards.padded_len
        return (b + self.shards.rank_positions(rank)[None]).flatten()

    def allgather_flat_ids(self) -> Tensor:
        """Flat ids of an all-gathered buffer ``[W * B * L]``, ordered (rank, row, local row)."""
        return torch.cat([self.local_flat_ids(r) for r in range(self.shards.world)])

    def work_per_rank(self, window_left: int = -1) -> list[int]:
        """Attention work of each rank: the number of (query, key) pairs its real queries attend, i.e. the
        sum over its queries of the keys each may see (the causal, windowed extent inside its document)."""
        return self.documents.work_per_rank(window_left)

    def real_tokens_per_rank(self) -> list[int]:
        """Real (non-padding) tokens held by each rank, over all rows."""
        return self.documents.real_tokens_per_rank()

    def fingerprint(self) -> bytes:
        h = hashlib.sha256()
        h.update(self.layout.segments.numpy().tobytes())
        h.update(f"|{(self.layout.batch_size, self.layout.seq_len)}|{self.shards.world}|{self.shards.layout}|".encode())
        h.update(self.shards.runs.numpy().tobytes())
        return h.digest()


# Modelled step cost of a layout, in attention (query, key) pairs of fwd + bwd; prices measured on CPU with
# H = 8, Hkv = 2, D = 64 over gloo (bench: exchange and kernel sections), rounded.
LAYOUT_COST = {
    "kv_token": 64.0,  # one K/V token received (forward) and its gradient sent back (backward)
    "cut_piece": 4096.0,  # one piece whose document started on another rank: a prefix block and its merge
}


def cut_pieces_per_rank(plan: StepPlan) -> list[int]:
    """Per rank: pieces (runs of consecutive positions of one document) whose document starts before them,
    i.e. whose earlier part lives on another rank."""
    return plan.documents.cut_pieces_per_rank()


def modelled_cost(plan: StepPlan) -> float:
    """The slowest rank's modelled step cost (attention work + received K/V tokens + cut pieces), in pairs:
    every term from the pieces' intervals, ``O(documents + shard runs)``."""
    work = plan.work_per_rank()
    recv = plan.exchange(-1).needed_tokens()
    cuts = cut_pieces_per_rank(plan)
    return max(w + LAYOUT_COST["kv_token"] * r + LAYOUT_COST["cut_piece"] * c for w, r, c in zip(work, recv, cuts))


def _cost_floor(work: CumulativeWork, interiors: tuple[Tensor, Tensor], runs: Tensor, world: int,
                batch_size: int = 1) -> float:
    """A lower bound of :func:`modelled_cost` from the shard runs alone: the largest, over the ranks, of the rank's
    attention work, its runs that start inside a document (each the start of a cut piece) and the keys their
    first queries need from other ranks. A cut run starting at ``s`` needs the keys of its document before
    ``s``; those from the document's start (one row: ``interiors`` are the documents') or from the end of the
    rank's run before it, whichever is later, lie on no run of its rank and on no other run's share. With
    several rows a run may start inside a document of any one of them: one key (the position before ``s``).

    >>> layout = DocLayout.from_seqlens([6, 2])
    >>> plan = StepPlan(layout=layout, shards=plan_shards(8, 2, "contiguous"))  # rank 1 starts inside the 6
    >>> plan.work_per_rank(), plan.exchange(-1).needed_tokens()
    ([10, 14], [0, 4])
    >>> _cost_floor(CumulativeWork(layout), doc_interiors(layout), plan.shards.runs, 2), modelled_cost(plan)
    (4366.0, 4366.0)
    """
    r = runs.numpy()
    rank, start = r[:, 0], r[:, 1]
    if not ((rank[1:] > rank[:-1]) | ((rank[1:] == rank[:-1]) & (start[1:] > start[:-1]))).all():
        r = r[np.lexsort((start, rank))]  # by rank, then start (the layouts' runs come so: then no sort)
        rank, start = r[:, 0], r[:, 1]
    starts, ends = interiors[0].numpy(), interiors[1].numpy()
    inside = np.zeros(start.shape, dtype=bool)
    keys = np.zeros(start.shape, dtype=np.int64)
    if starts.size:
        j = np.maximum(_search(starts, start, "right") - 1, 0)
        inside = (start >= starts[j]) & (start < ends[j])
        if batch_size == 1:
            prev_end = np.full(start.shape, -1, dtype=np.int64)
            same = rank[1:] == rank[:-1]
            prev_end[1:][same] = (start + r[:, 2])[:-1][same]
            keys = np.where(inside, start - np.maximum(starts[j] - 1, prev_end), 0)
        else:
            keys = inside.astype(np.int64)
    cuts = np.bincount(rank, weights=inside, minlength=world)
    recv = np.bincount(rank, weights=keys, minlength=world)
    cost = work.per_rank(runs, world) + LAYOUT_COST["kv_token"] * recv + LAYOUT_COST["cut_piece"] * cuts
    return float(cost.max())


def choose_layout(doc_layout: DocLayout, world: int, only: str | None = None, *,
                  every_cost: bool = True) -> tuple[StepPlan, dict[str, float]]:
    """``layout="auto"``: the candidate with the lowest :func:`modelled_cost` (ties: the first of contiguous,
    balanced, snapped) and the candidates' costs. A pure function of the doc ids: identical on all ranks.
    ``only`` keeps one candidate (``snapped`` falls back to ``balanced`` where no snapped layout qualifies).
    Every candidate is a few shard runs and its cost comes from its pieces' intervals, so trying all three
    costs what the documents and the ranks cost.

    ``every_cost=False`` (what :func:`plan_step` does) costs the candidates in the order of a lower bound of
    their cost read from the shard runs alone (:func:`_cost_floor`), and skips a candidate whose bound already
    exceeds the best cost found: the same choice, without the pieces and needed sets of a layout that cannot
    win (its cost is then missing from the dict). On one rank it costs contiguous alone, which no layout can beat
    there."""
    S = doc_layout.seq_len
    if only is not None and only not in ("contiguous", "snapped", "balanced"):
        raise ValueError(f"layout: expected auto:contiguous, auto:snapped or auto:balanced, got auto:{only}")
    if world == 1 and only is None and not every_cost:
        # one rank holds every position under any layout: contiguous, one run per row, cuts no document and
        # receives no key, so its cost (the total work) is the least there is, and it wins ties
        plan = StepPlan(layout=doc_layout, shards=plan_shards(S, 1, "contiguous").with_layout("auto:contiguous"))
        return plan, {"contiguous": modelled_cost(plan)}
    work, interiors = CumulativeWork(doc_layout), doc_interiors(doc_layout)
    candidates = {}
    if only in (None, "contiguous"):
        candidates["contiguous"] = plan_shards(S, world, "contiguous")
    if only in (None, "balanced", "snapped"):
        candidates["balanced"] = plan_shards(S, world, "balanced", work=work)
    if only in (None, "snapped"):
        snapped = snapped_runs(work, world, interiors)
        if snapped is not None:
            L, runs, _ = snapped
            candidates["snapped"] = ShardPlan(world=world, seq_len=S, local_len=L, runs=runs)
            if only == "snapped":
                del candidates["balanced"]
    rank_of = {name: i for i, name in enumerate(candidates)}  # the tie order
    names = list(candidates)
    if not every_cost and len(names) > 1:
        bound = {name: _cost_floor(work, interiors, shards.runs, world, doc_layout.batch_size)
                 for name, shards in candidates.items()}
        names.sort(key=lambda name: (bound[name], rank_of[name]))
    costs, plans = {}, {}
    for name in names:
        # the bound is exact pairs in float64; the margin keeps rounding from skipping a tie
        if not every_cost and costs and bound[name] * (1 - 1e-9) > min(costs.values()):
            continue
        plans[name] = StepPlan(layout=doc_layout, shards=candidates[name].with_layout(f"auto:{name}"))
        costs[name] = modelled_cost(plans[name])
    best = min(costs, key=lambda name: (costs[name], rank_of[name]))
    return plans[best], costs


def plan_step(doc_ids: Tensor | DocLayout, world: int, layout: str = "contiguous") -> StepPlan:
    """The step plan for full doc ids ``[B, S]`` (or their :class:`DocLayout`, e.g. from
    :func:`blockdiag_ref.layout_from_batch`, which reads no doc-id tensor) on ``world`` ranks (pure).
    ``layout="auto"`` picks the cheapest of contiguous, balanced and snapped (see :func:`choose_layout`); the
    plan's ``shards.layout`` then reads ``auto:<choice>``."""
    doc_layout = doc_ids if isinstance(doc_ids, DocLayout) else DocLayout.from_doc_ids(doc_ids.cpu())
    if layout == "auto":
        return choose_layout(doc_layout, world, every_cost=False)[0]
    if layout.startswith("auto:"):  # one candidate of auto, forced (tests, benchmarks)
        return choose_layout(doc_layout, world, only=layout[5:], every_cost=False)[0]
    work = CumulativeWork(doc_layout) if layout == "balanced" else None
    return StepPlan(layout=doc_layout, shards=plan_shards(doc_layout.seq_len, world, layout, work=work))
