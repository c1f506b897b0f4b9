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

import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from .balance import CumulativeWork, doc_interiors, snapped_runs
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

    Stored as *intervals*: ``spans`` int64 ``[K, 6]``, one row ``(dest, src, row, start, length, src_local)`` per
    run of keys that rank ``dest`` needs from rank ``src``: positions ``[start, start + length)`` of batch row
    ``row``, held by ``src`` from its local row ``src_local`` on; ordered by destination, then flat id, disjoint.
    ``counts[s, d]``: tokens ``s`` sends ``d``. Keys at padding positions are never needed.

    The token-level view (``flat_ids[i]`` needed by rank ``dest[i]`` and held by rank ``src[i]``, ordered by
    destination then flat id) is built when asked; a rank's own send rows and received flat ids
    (:meth:`send_rows`, :meth:`recv_flat_ids`) are built from its intervals only.
    """

    def __init__(self, shards: ShardPlan, batch_size: int, window_left: int, spans: Tensor, counts: Tensor) -> None:
        self.shards, self.batch_size, self.window_left = shards, batch_size, window_left
        self.spans, self.counts = spans, counts

    @property
    def world(self) -> int:
        return self.shards.world

    @property
    def local_tokens(self) -> int:
        return self.batch_size * self.shards.local_len

    def _flat_of(self, spans: Tensor) -> Tensor:
        return interval_ranges(spans[:, 2] * self.shards.padded_len + spans[:, 3], spans[:, 4])

    @cached_property
    def flat_ids(self) -> Tensor:
        """int64 ``[N]``: every needed key's flat id, by destination then flat id (token-level; built when asked)."""
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
        return tuple(self._flat_of(self._spans_to(r)) for r in range(self.world))

    @cached_property
    def _dest_bounds(self) -> list[int]:
        return torch.searchsorted(self.spans[:, 0].contiguous(), torch.arange(self.world + 1)).tolist()

    def _spans_to(self, rank: int) -> Tensor:
        return self.spans[self._dest_bounds[rank]:self._dest_bounds[rank + 1]]

    @cached_property
    def halo_ok(self) -> bool:
        """Every rank's needed keys lie on its left neighbour (so one point-to-point hop suffices)."""
        return bool((self.spans[:, 1] == self.spans[:, 0] - 1).all())

    def needed_tokens(self) -> list[int]:
        """Per rank: tokens received by a needed-only exchange (the minimum)."""
        return self.counts.sum(0).tolist()

    def sent_tokens(self) -> list[int]:
        """Per rank: tokens sent by a needed-only exchange."""
        return self.counts.sum(1).tolist()

    def allgather_tokens(self) -> int:
        """Per rank: tokens received (and sent) by an all-gather."""
        return (self.world - 1) * self.local_tokens

    def recv_flat_ids(self, rank: int) -> Tensor:
        """Flat ids ``rank`` receives, in arrival order of a needed-only exchange: by source rank, then flat id."""
        mine = self._spans_to(rank)
        return self._flat_of(mine[torch.sort(mine[:, 1], stable=True).indices])

    def send_rows(self, rank: int, dest: int | None = None) -> Tensor:
        """Local token indices (``b * L + l``) that ``rank`` sends, grouped by destination in rank order (or
        only those for ``dest``), each group in the order its destination expects."""
        mine = self.spans[:, 1] == rank
        if dest is not None:
            mine &= self.spans[:, 0] == dest
        s = self.spans[mine]
        return interval_ranges(s[:, 2] * self.shards.local_len + s[:, 5], s[:, 4])

    def fingerprint(self) -> bytes:
        h = hashlib.sha256()
        for t in (self.shards.runs, self.counts, self.spans):
            h.update(t.numpy().tobytes())
            h.update(b"|")
        h.update(f"{self.window_left}".encode())
        return h.digest()


def needed_mask(layout: DocLayout, shards: ShardPlan, window_left: int) -> Tensor:
    """bool ``[W, B * Sp]``: whether rank ``r`` needs the key with flat id ``f`` from another rank (token-level:
    for tests and tools; the plans use :func:`needed_spans`)."""
    x = plan_exchange(layout, shards, window_left)
    out = torch.zeros(shards.world, layout.batch_size * shards.padded_len, dtype=torch.bool)
    out[x.dest, x.flat_ids] = True
    return out


def needed_spans(docs: DocPlan, window_left: int) -> Tensor:
    """The needed sets as intervals ``[K, 6]`` (see :class:`ExchangePlan`), from the pieces.

    A piece ``[s, e)`` of a document starting at ``d`` has real queries that see the keys ``[max(d, s - left), s)``
    before it (all of them: its first query sees every one). Per (rank, document), these ranges are merged
    (pieces in document order, each range starting no earlier than the one before), then cut at the shard's
    runs; the parts held by another rank are needed. ``O(P + K)``.
    """
    shards, sp = docs.shards, docs.shards.padded_len
    t = docs.table
    lo = t["doc_start"] if window_left < 0 else torch.maximum(t["doc_start"], t["start"] - window_left)
    hi = t["start"]
    keep = lo < hi
    rank, doc, row, lo, hi = t["rank"][keep], t["doc"][keep], t["row"][keep], lo[keep], hi[keep]
    order = torch.argsort(rank * (docs.num_docs * sp) + doc * sp + hi)  # by rank, document, then position
    rank, doc, row, lo, hi = rank[order], doc[order], row[order], lo[order], hi[order]
    if rank.numel() == 0:
        return torch.zeros(0, 6, dtype=torch.int64)
    new = torch.ones(rank.numel(), dtype=torch.bool)
    new[1:] = (rank[1:] != rank[:-1]) | (doc[1:] != doc[:-1]) | (lo[1:] > hi[:-1])
    first = new.nonzero().flatten()
    last = torch.cat([first[1:], torch.tensor([rank.numel()], dtype=torch.int64)]) - 1
    rank, row, lo, hi = rank[first], row[first], lo[first], hi[last]
    # cut each merged range at the shard's runs: runs sorted by position tile [0, Sp)
    runs = shards.by_position
    run_start = runs[:, 1].contiguous()
    r0 = torch.searchsorted(run_start, lo, right=True) - 1
    r1 = torch.searchsorted(run_start, hi - 1, right=True) - 1
    n = r1 - r0 + 1
    k = torch.repeat_interleave(torch.arange(rank.numel()), n)
    run = interval_ranges(r0, n)
    src = runs[run, 0]
    a = torch.maximum(lo[k], runs[run, 1])
    b = torch.minimum(hi[k], runs[run, 1] + runs[run, 2])
    spans = torch.stack([rank[k], src, row[k], a, b - a, runs[run, 3] + a - runs[run, 1]], 1)
    spans = spans[src != rank[k]]
    return spans[torch.argsort(spans[:, 0] * (docs.batch_size * sp) + spans[:, 2] * sp + spans[:, 3])]


def plan_exchange(layout: DocLayout, shards: ShardPlan, window_left: int = -1, *, docs: DocPlan | None = None) -> ExchangePlan:
    """Needed sets and per-pair counts of every rank (pure; identical on every rank), from the pieces
    (``docs``: the step's :class:`~blockdiag_dist.docs.DocPlan`, built here when not given)."""
    docs = plan_documents(layout, shards) if docs is None else docs
    spans = needed_spans(docs, window_left)
    W = shards.world
    counts = torch.zeros(W * W, dtype=torch.int64).index_add_(0, spans[:, 1] * W + spans[:, 0], spans[:, 4]).view(W, W)
    return ExchangePlan(shards=shards, batch_size=layout.batch_size, window_left=window_left, spans=spans, counts=counts)


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
        h.update(f"|{tuple(self.layout.doc_ids.shape)}|{self.shards.world}|{self.shards.layout}|".encode())
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


def choose_layout(doc_layout: DocLayout, world: int, only: str | None = None) -> tuple[StepPlan, dict[str, float]]:
    """``layout="auto"``: the candidate with the lowest :func:`modelled_cost` (ties: the first of contiguous,
    balanced, snapped) and every candidate's cost. A pure function of the doc ids: identical on all ranks.
    ``only`` keeps one candidate (``snapped`` falls back to ``balanced`` where no snapped layout qualifies).
    Every candidate is a few shard runs and its cost comes from its pieces' intervals, so trying all three
    costs what the documents and the ranks cost."""
    S = doc_layout.seq_len
    if only is not None and only not in ("contiguous", "snapped", "balanced"):
        raise ValueError(f"layout: expected auto:contiguous, auto:snapped or auto:balanced, got auto:{only}")
    work = CumulativeWork(doc_layout)
    candidates = {}
    if only in (None, "contiguous"):
        candidates["contiguous"] = plan_shards(S, world, "contiguous")
    if only in (None, "balanced", "snapped"):
        candidates["balanced"] = plan_shards(S, world, "balanced", work=work)
    if only in (None, "snapped"):
        snapped = snapped_runs(work, world, doc_interiors(doc_layout))
        if snapped is not None:
            L, runs, _ = snapped
            candidates["snapped"] = ShardPlan(world=world, seq_len=S, local_len=L, runs=runs)
            if only == "snapped":
                del candidates["balanced"]
    costs, best = {}, None
    for name, shards in candidates.items():
        plan = StepPlan(layout=doc_layout, shards=shards.with_layout(f"auto:{name}"))
        costs[name] = modelled_cost(plan)
        if best is None or costs[name] < costs[best[0]]:
            best = (name, plan)
    return best[1], costs


def plan_step(doc_ids: Tensor, world: int, layout: str = "contiguous") -> StepPlan:
    """The step plan for full doc ids ``[B, S]`` on ``world`` ranks (pure). ``layout="auto"`` picks the
    cheapest of contiguous, balanced and snapped (see :func:`choose_layout`); the plan's ``shards.layout``
    then reads ``auto:<choice>``."""
    doc_layout = DocLayout.from_doc_ids(doc_ids.cpu())
    if layout == "auto":
        return choose_layout(doc_layout, world)[0]
    if layout.startswith("auto:"):  # one candidate of auto, forced (tests, benchmarks)
        return choose_layout(doc_layout, world, only=layout[5:])[0]
    work = CumulativeWork(doc_layout) if layout == "balanced" else None
    return StepPlan(layout=doc_layout, shards=plan_shards(doc_layout.seq_len, world, layout, work=work))
