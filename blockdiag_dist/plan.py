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

import dataclasses
import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from .balance import doc_boundaries, position_work, snapped_positions
from .docs import plan_documents
from .shard_plan import ShardPlan, padded_doc_starts, padded_segments, plan_shards

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


@dataclass(frozen=True, eq=False)
class ExchangePlan:
    """Needed sets for one window: which keys each rank's real queries may see that live on other ranks.

    Stored as one list of (destination, key) pairs ordered by destination, then flat id: ``flat_ids[i]`` is
    needed by rank ``dest[i]`` and held by rank ``src[i]``. ``counts[s, d]``: tokens ``s`` sends ``d``. Keys
    at padding positions are never needed.
    """

    shards: ShardPlan
    batch_size: int
    window_left: int
    flat_ids: Tensor  # int64 [N]
    dest: Tensor  # int64 [N]
    src: Tensor  # int64 [N]
    counts: Tensor  # int64 [W (source), W (destination)]

    @property
    def world(self) -> int:
        return self.shards.world

    @property
    def local_tokens(self) -> int:
        return self.batch_size * self.shards.local_len

    @cached_property
    def needed(self) -> tuple[Tensor, ...]:
        """Per rank: sorted flat ids of the tokens it needs from other ranks."""
        return tuple(self.flat_ids.split(self.counts.sum(0).tolist()))

    @cached_property
    def halo_ok(self) -> bool:
        """Every rank's needed keys lie on its left neighbour (so one point-to-point hop suffices)."""
        return bool((self.src == self.dest - 1).all())

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
        mine = self.dest == rank
        ids, src = self.flat_ids[mine], self.src[mine]
        return ids[torch.sort(src, stable=True).indices]

    def send_rows(self, rank: int, dest: int | None = None) -> Tensor:
        """Local token indices (``b * L + l``) that ``rank`` sends, grouped by destination in rank order (or
        only those for ``dest``), each group in the order its destination expects."""
        sp, L = self.shards.padded_len, self.shards.local_len
        mine = self.src == rank
        if dest is not None:
            mine &= self.dest == dest
        ids = self.flat_ids[mine]
        return (ids // sp) * L + self.shards.owner_row[ids % sp]

    def fingerprint(self) -> bytes:
        h = hashlib.sha256()
        for t in (self.shards.positions, self.counts, self.flat_ids, self.dest):
            h.update(t.numpy().tobytes())
            h.update(b"|")
        h.update(f"{self.window_left}".encode())
        return h.digest()


def needed_mask(layout: DocLayout, shards: ShardPlan, window_left: int) -> Tensor:
    """bool ``[W, B * Sp]``: whether rank ``r`` needs the key with flat id ``f`` from another rank.

    A key at ``p`` is needed by rank ``r`` iff some real query ``q`` of ``r`` lies in the same document with
    ``p <= q`` (and ``q - p <= left`` under a window), and ``p`` lives on another rank. Documents are
    contiguous runs, so it suffices to look at the nearest query ``q >= p`` of ``r``: if it lies in another
    document, no query of ``p``'s document follows on ``r``. All ranks are computed at once, ``[W, B, Sp]``.
    """
    seg = padded_segments(layout, shards)  # [B, Sp]
    W, sp = shards.world, shards.padded_len
    pos = torch.arange(sp)
    ranks = torch.arange(W)[:, None]
    is_query = (shards.owner[None, :] == ranks)[:, None, :] & (seg != 0)[None]  # [W, B, Sp]
    qpos = torch.where(is_query, pos, sp)
    next_q = torch.flip(torch.cummin(torch.flip(qpos, [2]), dim=2).values, [2])
    same_doc = seg[None].expand(W, -1, -1).gather(2, next_q.clamp(max=sp - 1)) == seg[None]
    elsewhere = (shards.owner[None, :] != ranks)[:, None, :]  # [W, 1, Sp]
    need = (next_q < sp) & same_doc & (seg != 0)[None] & elsewhere
    if window_left >= 0:
        need &= (next_q - pos) <= window_left
    return need.flatten(1)


def plan_exchange(layout: DocLayout, shards: ShardPlan, window_left: int = -1) -> ExchangePlan:
    """Needed sets and per-pair counts of every rank (pure; identical on every rank)."""
    dest, flat = needed_mask(layout, shards, window_left).nonzero().unbind(1)
    src = shards.owner[flat % shards.padded_len]
    W = shards.world
    counts = torch.bincount(src * W + dest, minlength=W * W).view(W, W)
    return ExchangePlan(
        shards=shards, batch_size=layout.batch_size, window_left=window_left, flat_ids=flat, dest=dest, src=src,
        counts=counts,
    )


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
        """int64 ``[B * Sp]`` segment id per flat id (0 = padding)."""
        return padded_segments(self.layout, self.shards).flatten()

    @cached_property
    def documents(self):
        """The step's documents and every rank's pieces of them (:class:`blockdiag_dist.docs.DocPlan`)."""
        return plan_documents(self.layout, self.shards)

    @cached_property
    def doc_starts(self) -> Tensor:
        """int64 ``[B * Sp]`` start position of the document of each flat id (-1 = padding)."""
        return padded_doc_starts(self.layout, self.shards).flatten()

    def exchange(self, window_left: int) -> ExchangePlan:
        """Needed sets for a window (computed once per window per step, then cached)."""
        plan = self._exchanges.get(window_left)
        if plan is None:
            plan = self._exchanges.setdefault(window_left, plan_exchange(self.layout, self.shards, window_left))
        return plan

    @cached_property
    def _local_flat_ids(self) -> Tensor:
        """int64 ``[W, B * L]``: flat ids of every rank's local tokens, in local order (row-major ``[B, L]``)."""
        sp = self.shards.padded_len
        b = torch.arange(self.layout.batch_size)[None, :, None]
        return (b * sp + self.shards.positions[:, None, :]).flatten(1)

    def local_flat_ids(self, rank: int) -> Tensor:
        """Flat ids of ``rank``'s local tokens, ``[B * L]`` in local order (row-major over ``[B, L]``)."""
        return self._local_flat_ids[rank]

    def allgather_flat_ids(self) -> Tensor:
        """Flat ids of an all-gathered buffer ``[W * B * L]``, ordered (rank, row, local row)."""
        return self._local_flat_ids.flatten()

    def work_per_rank(self, window_left: int = -1) -> list[int]:
        """Attention work of each rank: the number of (query, key) pairs its real queries attend, i.e. the
        sum over its queries of the keys each may see (the causal, windowed extent inside its document)."""
        sp = self.shards.padded_len
        pos = torch.arange(sp).repeat(self.layout.batch_size)
        start = self.doc_starts
        if window_left >= 0:
            start = torch.maximum(start, pos - window_left)
        keys = torch.where(self.segments != 0, pos - start + 1, 0).view(-1, sp)  # [B, Sp]
        return keys.sum(0)[self.shards.positions].sum(1).tolist()

    def real_tokens_per_rank(self) -> list[int]:
        """Real (non-padding) tokens held by each rank, over all rows."""
        real = (self.segments != 0).view(-1, self.shards.padded_len).sum(0)
        return real[self.shards.positions].sum(1).tolist()

    def fingerprint(self) -> bytes:
        h = hashlib.sha256()
        h.update(self.layout.doc_ids.numpy().tobytes())
        h.update(f"|{tuple(self.layout.doc_ids.shape)}|{self.shards.world}|{self.shards.layout}|".encode())
        h.update(self.shards.positions.numpy().tobytes())
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
    seg = padded_segments(plan.layout, plan.shards)  # [B, Sp]
    pos = plan.shards.positions  # [W, L]
    s = seg[:, pos]  # [B, W, L]
    prev_s = torch.nn.functional.pad(s[..., :-1], (1, 0))
    prev_p = torch.nn.functional.pad(pos[:, :-1], (1, 0), value=-2)
    starts = torch.nn.functional.pad(plan.layout.segments[:, 1], (1, 0), value=0)[s]
    first = (s != 0) & ((s != prev_s) | (pos != prev_p + 1)[None])
    return (first & (pos[None] > starts)).sum((0, 2)).tolist()


def modelled_cost(plan: StepPlan) -> float:
    """The slowest rank's modelled step cost (attention work + received K/V tokens + cut pieces), in pairs."""
    work = plan.work_per_rank()
    recv = plan.exchange(-1).needed_tokens()
    cuts = cut_pieces_per_rank(plan)
    return max(w + LAYOUT_COST["kv_token"] * r + LAYOUT_COST["cut_piece"] * c for w, r, c in zip(work, recv, cuts))


def choose_layout(doc_layout: DocLayout, world: int, only: str | None = None) -> tuple[StepPlan, dict[str, float]]:
    """``layout="auto"``: the candidate with the lowest :func:`modelled_cost` (ties: the first of contiguous,
    balanced, snapped) and every candidate's cost. A pure function of the doc ids: identical on all ranks.
    ``only`` keeps one candidate (``snapped`` falls back to ``balanced`` where no snapped layout qualifies)."""
    S = doc_layout.seq_len
    work = position_work(doc_layout)
    candidates = {"contiguous": plan_shards(S, world, "contiguous"), "balanced": plan_shards(S, world, "balanced", work=work)}
    snapped = snapped_positions(work, world, doc_boundaries(doc_layout))
    if snapped is not None:
        L, positions, _ = snapped
        candidates["snapped"] = ShardPlan(world=world, seq_len=S, local_len=L, positions=positions)
    if only is not None:
        if only not in ("contiguous", "snapped", "balanced"):
            raise ValueError(f"layout: expected auto:contiguous, auto:snapped or auto:balanced, got auto:{only}")
        candidates = {k: v for k, v in candidates.items() if k == only} or {"balanced": candidates["balanced"]}
    costs, best = {}, None
    for name, shards in candidates.items():
        shards = dataclasses.replace(shards, layout=f"auto:{name}")
        plan = StepPlan(layout=doc_layout, shards=shards)
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
    work = position_work(doc_layout) if layout == "balanced" else None
    return StepPlan(layout=doc_layout, shards=plan_shards(doc_layout.seq_len, world, layout, work=work))
