"""The plans built from intervals (documents x shard runs) equal the token-level plans they replaced, on random
layouts (hypothesis): needed sets and routes, pieces and segment boundaries, work, cut pieces, balanced and snapped
shards, the varlen kernel's pieces and the reference layout's per-token views. The token-level algorithms below
are the ones the plans used before (per-token tensors ``[W, B, Sp]``), kept here as the oracle; the brute-force
comparisons with the reference mask stay in test_dist_plan.py and test_docs_plan.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from blockdiag_dist.balance import (
    CumulativeWork, balanced_positions, balanced_runs, doc_boundaries, doc_interiors, position_work, snapped_positions,
    snapped_runs,
)
from blockdiag_dist.kernels.varlen import plan_varlen, plan_varlen_pieces
from blockdiag_dist.plan import cut_pieces_per_rank, plan_step
from blockdiag_dist.shard_plan import FlatIndex, ShardPlan, interval_ranges
from blockdiag_ref import DocLayout

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def layouts(draw, max_rows: int = 3, max_len: int = 40):
    """``[B, S]`` doc ids made of runs (lengths 1..9) of ids 0..3: padding anywhere, reused ids, single tokens."""
    B = draw(st.integers(1, max_rows))
    S = draw(st.integers(1, max_len))
    rows = []
    for _ in range(B):
        row: list[int] = []
        while len(row) < S:
            row += [draw(st.integers(0, 3))] * draw(st.integers(1, 9))
        rows.append(row[:S])
    return torch.tensor(rows)


LAYOUT_NAMES = st.sampled_from(["contiguous", "balanced", "auto:snapped", "auto"])


# ---- the token-level plans (the oracle) -------------------------------------------------------------------------
def token_segments(ids: torch.Tensor, sp: int) -> torch.Tensor:
    """Segment ids ``[B, Sp]`` by a cumulative count of document starts (0 = padding)."""
    real = ids != 0
    prev = torch.nn.functional.pad(ids[:, :-1], (1, 0))
    starts = real & (ids != prev)
    seg = torch.cumsum(starts.flatten(), 0).view_as(ids) * real
    return torch.nn.functional.pad(seg, (0, sp - ids.shape[1]))


def token_owner(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    W, L = positions.shape
    owner, row = torch.empty(W * L, dtype=torch.int64), torch.empty(W * L, dtype=torch.int64)
    owner[positions.flatten()] = torch.arange(W).repeat_interleave(L)
    row[positions.flatten()] = torch.arange(L).repeat(W)
    return owner, row


def token_needed(seg: torch.Tensor, positions: torch.Tensor, left: int) -> torch.Tensor:
    """bool ``[W, B * Sp]``: the nearest query of each rank at or after a key lies in the key's document."""
    W, L = positions.shape
    sp = W * L
    owner, _ = token_owner(positions)
    pos = torch.arange(sp)
    ranks = torch.arange(W)[:, None]
    is_query = (owner[None, :] == ranks)[:, None, :] & (seg != 0)[None]
    qpos = torch.where(is_query, pos, sp)
    next_q = torch.flip(torch.cummin(torch.flip(qpos, [2]), dim=2).values, [2])
    same_doc = seg[None].expand(W, -1, -1).gather(2, next_q.clamp(max=sp - 1)) == seg[None]
    elsewhere = (owner[None, :] != ranks)[:, None, :]
    need = (next_q < sp) & same_doc & (seg != 0)[None] & elsewhere
    if left >= 0:
        need &= (next_q - pos) <= left
    return need.flatten(1)


def token_pieces(seg: torch.Tensor, positions: torch.Tensor) -> list[tuple[int, int, int, int, int, int]]:
    """(rank, doc, row, start, length, local_start) of every run of one document on consecutive rows."""
    B = seg.shape[0]
    out = []
    for r, pos in enumerate(positions.tolist()):
        for b in range(B):
            for l, p in enumerate(pos):
                s = int(seg[b, p])
                if s == 0:
                    continue
                if l > 0 and pos[l - 1] == p - 1 and int(seg[b, pos[l - 1]]) == s:
                    out[-1][4] += 1
                else:
                    out.append([r, s - 1, b, p, 1, l])
    return sorted(tuple(x) for x in out)


def token_work(seg: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor, left: int) -> list[int]:
    sp = seg.shape[1]
    pos = torch.arange(sp)
    st_ = starts if left < 0 else torch.maximum(starts, pos - left)
    keys = torch.where(seg != 0, pos - st_ + 1, 0)
    return keys.sum(0)[positions].sum(1).tolist()


# ---- the properties ------------------------------------------------------------------------------------------
@SETTINGS
@given(ids=layouts(), world=st.integers(1, 8), name=LAYOUT_NAMES, left=st.sampled_from([-1, 0, 1, 3]))
def test_needed_sets_and_routes_equal_the_token_plan(ids, world, name, left):
    plan = plan_step(ids, world, name)
    positions = plan.shards.positions
    sp, L = plan.shards.padded_len, plan.shards.local_len
    seg = token_segments(ids, sp)
    need = token_needed(seg, positions, left)
    dest, flat = need.nonzero().unbind(1)
    owner, owner_row = token_owner(positions)
    src = owner[flat % sp]
    x = plan.exchange(left)
    assert torch.equal(x.flat_ids, flat) and torch.equal(x.dest, dest) and torch.equal(x.src, src)
    counts = torch.bincount(src * world + dest, minlength=world * world).view(world, world)
    assert torch.equal(x.counts, counts)
    assert x.needed_tokens() == counts.sum(0).tolist() and x.sent_tokens() == counts.sum(1).tolist()
    assert x.halo_ok == bool((src == dest - 1).all())
    for r in range(world):
        mine = dest == r
        assert torch.equal(x.recv_flat_ids(r), flat[mine][torch.sort(src[mine], stable=True).indices])
        assert x.recv_counts(r) == counts[:, r].tolist() and x.send_counts(r) == counts[r].tolist()
        ids_sent = flat[src == r]
        assert torch.equal(x.send_rows(r), (ids_sent // sp) * L + owner_row[ids_sent % sp])
        for d in range(world):
            ids_d = flat[(src == r) & (dest == d)]
            assert torch.equal(x.send_rows(r, d), (ids_d // sp) * L + owner_row[ids_d % sp])


@SETTINGS
@given(ids=layouts(), world=st.integers(1, 8), name=LAYOUT_NAMES, left=st.sampled_from([-1, 0, 2]))
def test_pieces_work_and_cuts_equal_the_token_plan(ids, world, name, left):
    plan = plan_step(ids, world, name)
    positions = plan.shards.positions
    sp = plan.shards.padded_len
    seg = token_segments(ids, sp)
    docs = plan.documents
    got = sorted((p.rank, p.doc, p.row, p.start, p.length, p.local_start) for p in docs.pieces)
    assert got == token_pieces(seg, positions)
    spans = DocLayout.from_doc_ids(ids).segments
    starts = torch.cat([torch.tensor([-1]), spans[:, 1]])[seg]
    assert plan.work_per_rank(left) == token_work(seg, starts, positions, left)
    assert plan.real_tokens_per_rank() == (seg != 0).sum(0)[positions].sum(1).tolist()
    cuts = [0] * world
    for p in docs.pieces:
        cuts[p.rank] += int(p.start > p.doc_start)
    assert cut_pieces_per_rank(plan) == cuts
    # the padded stream's segments: a boundary where the segment id changes and at every row start
    flat = seg.flatten()
    change = torch.ones(flat.numel(), dtype=torch.bool)
    change[1:] = flat[1:] != flat[:-1]
    change[torch.arange(ids.shape[0]) * sp] = True
    b = change.nonzero().flatten()
    assert docs.cu_seqlens.tolist() == b.tolist() + [flat.numel()]
    assert docs.segment_doc.tolist() == (flat[b] - 1).tolist()
    for r in range(world):  # each rank's view: its pieces in local order, every row's document and offset
        view = docs.for_rank(r)
        assert [p.index for p in view.pieces] == list(docs.by_rank[r])
        pos = positions[r]
        assert torch.equal(view.doc_index, seg[:, pos] - 1)
        assert torch.equal(view.doc_position, torch.where(seg[:, pos] != 0, pos - starts[:, pos], -1))


@SETTINGS
@given(ids=layouts(), world=st.integers(1, 8), name=LAYOUT_NAMES, left=st.sampled_from([-1, 0, 1, 4]))
def test_varlen_pieces_from_the_table_equal_those_from_per_token_segments(ids, world, name, left):
    plan = plan_step(ids, world, name)
    sp = plan.shards.padded_len
    key_flat = plan.allgather_flat_ids()
    for r in range(world):
        local = plan.local_flat_ids(r)
        old = plan_varlen(local, key_flat, plan.segments, plan.doc_starts, sp, left)
        new = plan_varlen_pieces(plan.documents.kernel_pieces(r), local.numel(), FlatIndex(key_flat), sp, left)
        for name_ in ("piece_q", "piece_k", "piece_flat", "pad_rows"):
            assert torch.equal(getattr(old, name_), getattr(new, name_)), name_
        assert torch.equal(new.pad_rows, (plan.segments[local] == 0).nonzero().flatten())  # the padding queries
        assert torch.equal(old.blocks.k_gather, new.blocks.k_gather) and torch.equal(old.blocks.out_rows, new.blocks.out_rows)


@SETTINGS
@given(ids=layouts(max_len=300), world=st.integers(2, 16))
def test_balanced_and_snapped_from_intervals_equal_those_from_per_position_work(ids, world):
    layout = DocLayout.from_doc_ids(ids)
    work = position_work(layout)
    S = layout.seq_len
    cum = CumulativeWork(layout)
    edges = torch.arange(0, S + 1)
    assert torch.equal(cum.at(edges), torch.nn.functional.pad(torch.cumsum(work, 0), (1, 0)))
    L, positions, imbalance = balanced_positions(work, world)
    L2, runs, imbalance2 = balanced_runs(cum, world)
    assert (L, imbalance) == (L2, imbalance2)
    assert torch.equal(positions, ShardPlan(world, S, L2, runs=runs).positions)
    a, b = doc_interiors(layout)
    bounds = torch.ones(S + 1, dtype=torch.bool)
    bounds[interval_ranges(a, b - a)] = False
    assert torch.equal(bounds, doc_boundaries(layout))
    old, new = snapped_positions(work, world, doc_boundaries(layout)), snapped_runs(cum, world, (a, b))
    assert (old is None) == (new is None)
    if old is not None:
        assert old[0] == new[0] and old[2] == new[2]
        assert torch.equal(old[1], ShardPlan(world, S, new[0], runs=new[1]).positions)


@SETTINGS
@given(ids=layouts(max_rows=4, max_len=60))
def test_reference_layout_views_equal_the_cumulative_count(ids):
    layout = DocLayout.from_doc_ids(ids)
    seg = token_segments(ids, ids.shape[1])
    assert torch.equal(layout.segment_ids, seg)
    assert torch.equal(layout.padding_mask, seg == 0)
    assert torch.equal(layout.unpad_indices, (seg != 0).flatten().nonzero().flatten())
    counts = torch.bincount(seg.flatten(), minlength=int(seg.max()) + 1)[1:]
    assert torch.equal(layout.cu_seqlens, torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32))


@SETTINGS
@given(ids=layouts(), world=st.integers(1, 6), name=LAYOUT_NAMES)
def test_shard_runs_and_token_views_agree(ids, world, name):
    shards = plan_step(ids, world, name).shards
    positions = shards.positions
    assert torch.equal(torch.sort(positions.flatten()).values, torch.arange(shards.padded_len))
    owner, row = token_owner(positions)
    assert torch.equal(shards.owner, owner) and torch.equal(shards.owner_row, row)
    rebuilt = ShardPlan(world, shards.seq_len, shards.local_len, positions=positions)
    assert torch.equal(rebuilt.runs, shards.runs)  # runs are maximal, whichever way the plan was built
    x = torch.arange(shards.padded_len + 1)
    for r in range(world):
        assert torch.equal(shards.rank_positions(r), positions[r])
        before = (positions[r][None, :] < x[:, None]).sum(1)
        assert torch.equal(shards.rows_before(torch.full_like(x, r), x), before)


def test_paper_model_counts_the_plans_bytes_and_work():
    """verify plan --model: received bytes are the needed sets (split by node), compute is the plan's work."""
    from verify.scale_model import H200, model_step

    ids = DocLayout.from_seqlens([700, 90, 1500, 33, 400]).doc_ids
    for layout in ("contiguous", "balanced"):
        plan = plan_step(ids, 8, layout)
        x = plan.exchange(-1)
        bpt = 2 * 2 * 16 * 2  # hkv 2, K and V, dim 16, bf16
        for g in (2, 8):
            m = model_step(ids, 8, layout=layout, hq=4, hkv=2, dim=16, machine={"gpus_per_node": g})
            assert m["mode"] == "a2a"
            for r, row in enumerate(m["ranks"]):
                assert row["recv_bytes_nvlink"] + row["recv_bytes_ib"] == x.needed_tokens()[r] * bpt
                from_other_nodes = sum(int(x.counts[s, r]) for s in range(8) if s // g != r // g)
                assert row["recv_bytes_ib"] == from_other_nodes * bpt
                flops = plan.work_per_rank()[r] * 4 * 16 * 4 * (1 + H200["backward_over_forward"])
                assert row["compute_s"] == flops / (H200["bf16_dense_flops"] * H200["attention_efficiency"])


@SETTINGS
@given(space=st.integers(1, 200), data=st.data())
def test_flat_index_equals_a_lookup_table(space, data):
    """The key buffer's index, by runs (searchsorted) and by its small-space table, against a plain table."""
    n = data.draw(st.integers(0, space))
    flat = torch.randperm(space, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))[:n]
    if data.draw(st.booleans()):
        flat = torch.sort(flat).values  # long runs of consecutive ids, as the plans give
    table = torch.full((space,), -1, dtype=torch.int64)
    table[flat] = torch.arange(n)
    x = torch.arange(space)
    assert torch.equal(FlatIndex(flat)[x], table) and torch.equal(FlatIndex(flat, space)[x], table)
    assert torch.equal(FlatIndex(flat).flat_ids(), flat)


def heap_assign(chunk_work: list[float], world: int, per_rank: int) -> tuple[list[list[int]], list[float]]:
    """The longest-processing-time assignment one chunk at a time from a heap of ``(load, rank)`` (the oracle of
    ``balance._lpt``), then the pairwise swaps one at a time (:func:`swap_one_at_a_time`)."""
    import heapq

    import numpy as np

    w = np.asarray(chunk_work, dtype=np.float64)
    owned: list[list[int]] = [[] for _ in range(world)]
    heap = [(0.0, r) for r in range(world)]
    for k in np.argsort(-w, kind="stable").tolist():
        load, r = heap[0]
        owned[r].append(k)
        if len(owned[r]) < per_rank:
            heapq.heapreplace(heap, (load + chunk_work[k], r))
        else:
            heapq.heappop(heap)
    loads = np.array([sum((chunk_work[k] for k in ks), 0.0) for ks in owned], dtype=np.float64)
    return swap_one_at_a_time(w, owned, loads)


def swap_one_at_a_time(w, owned: list[list[int]], loads) -> tuple[list[list[int]], list[float]]:
    """The oracle of ``balance._swaps``: while one lowers the larger load, swap the pair of chunks of the most
    loaded rank (ties: the lowest) and the least loaded (ties: the lowest) that lowers it the most (ties: the
    first pair), one swap at a time, at most ``_MAX_SWAPS``."""
    import numpy as np

    from blockdiag_dist.balance import _MAX_SWAPS

    loads = np.array(loads, dtype=np.float64)
    owned = [list(ks) for ks in owned]
    for _ in range(_MAX_SWAPS):
        hi, lo = int(np.argmax(loads)), int(np.argmin(loads))
        a_idx, b_idx = np.array(owned[hi]), np.array(owned[lo])
        d = w[a_idx][:, None] - w[b_idx][None, :]
        ok = (d > 0) & (d < loads[hi] - loads[lo])
        if not ok.any():
            break
        new_max = np.where(ok, np.maximum(loads[hi] - d, loads[lo] + d), np.inf)
        i = int(np.argmin(new_max))
        if new_max.flat[i] >= loads[hi]:
            break
        ia, ib = divmod(i, b_idx.size)
        dd = d[ia, ib]
        owned[hi][ia], owned[lo][ib] = int(b_idx[ib]), int(a_idx[ia])
        loads[hi] -= dd
        loads[lo] += dd
    return owned, loads.tolist()


# chunk works: ties (small integers), zeros (padding chunks), long tails (a few huge chunks among small ones)
CHUNK_WORKS = st.one_of(
    st.lists(st.integers(0, 4).map(float), min_size=1, max_size=8),
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=8),
    st.lists(st.sampled_from([0.0, 1.0, 3.0, 1e5]), min_size=1, max_size=8),
)


@SETTINGS
@given(world=st.integers(1, 80), per_rank=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_round_lpt_equals_one_chunk_at_a_time(world, per_rank, data):
    """balance._assign (LPT decided in rounds, a heap where rounds decide little) hands out every chunk as the
    one-at-a-time heap does, with bit-equal loads: the balanced and snapped layouts are unchanged."""
    from blockdiag_dist.balance import _assign

    pattern = data.draw(CHUNK_WORKS)
    n = world * per_rank
    work = [pattern[(i * 7 + i // 3) % len(pattern)] * (1 + (i % 5 == 0) * data.draw(st.integers(0, 3), label="bump"))
            if i < 12 else pattern[(i * 7 + i // 3) % len(pattern)] for i in range(n)]
    assert _assign(work, world, per_rank) == heap_assign(work, world, per_rank)


@SETTINGS
@given(world=st.integers(2, 300), per_rank=st.sampled_from([1, 2, 3, 8]), data=st.data())
def test_swaps_decided_in_batches_equal_one_at_a_time(world, per_rank, data):
    """balance._swaps (steps decided k at a time) takes every swap the one-at-a-time search takes, with bit-equal
    loads, from arbitrary starting assignments: they run to the step limit or a stop, through ties and zeros."""
    import numpy as np

    from blockdiag_dist.balance import _swaps

    n = world * per_rank
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    kind = data.draw(st.sampled_from(["ties", "exponential", "long tail", "squares", "sparse"]))
    w = {"ties": lambda: rng.integers(0, 5, n).astype(np.float64),
         "exponential": lambda: rng.exponential(1.0, n),
         "long tail": lambda: rng.choice([0.0, 1.0, 3.0, 1e5], n),
         "squares": lambda: np.floor(rng.exponential(100.0, n)) ** 2,
         "sparse": lambda: rng.random(n) * (rng.random(n) < 0.3)}[kind]()
    owned = rng.permutation(n).reshape(world, per_rank)
    loads = np.array([sum(w[k] for k in ks) for ks in owned.tolist()], dtype=np.float64)
    want = swap_one_at_a_time(w, owned.tolist(), loads)
    _swaps(w[owned], owned, loads, per_rank)
    assert (owned.tolist(), loads.tolist()) == want


@SETTINGS
@given(world=st.integers(1, 12), per_rank=st.sampled_from([1, 2, 3, 8]), data=st.data())
def test_heaviest_rank_floor_bounds_every_assignment(world, per_rank, data):
    """balance._heaviest_rank_floor is at most the largest per-rank sum of any assignment of exactly
    ``per_rank`` chunks per rank (integers: the sums are exact in float64), and it is the sum of one rank that
    an assignment can have: the largest chunk and the smallest others."""
    import numpy as np

    from blockdiag_dist.balance import _heaviest_rank_floor

    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    x = rng.choice([0.0, 1.0, 2.0, 7.0, 1000.0], world * per_rank)
    floor = _heaviest_rank_floor(x, per_rank)
    for _ in range(20):
        assert x[rng.permutation(x.size).reshape(world, per_rank)].sum(1).max() >= floor
    ordered = np.sort(x)
    assert floor == ordered[-1] + ordered[:per_rank - 1].sum()


def long_tail_layout(n_docs: int, S: int, seed: int) -> DocLayout:
    """One row of ``n_docs`` documents with exponential lengths (a few long ones among many short), ``S`` tokens."""
    import numpy as np

    w = np.random.default_rng(seed).exponential(1.0, n_docs)
    lengths = np.maximum(1, np.floor(w / w.sum() * S)).astype(np.int64)
    lengths[-1] += S - lengths.sum()
    while lengths[-1] < 1:  # the rounding took too much from the last one: give it back from the longest
        k = int(np.argmax(lengths[:-1]))
        lengths[k] -= 1
        lengths[-1] += 1
    return DocLayout.from_seqlens([lengths.tolist()])


def without_floors():
    """The searches as they were without the floors: every candidate assigned, every chunk count in turn."""
    from unittest import mock

    from blockdiag_dist import balance

    return mock.patch.object(balance, "_heaviest_rank_floor", lambda x, per_rank: -float("inf"))


@settings(max_examples=30, deadline=None)
@given(n_docs=st.integers(1, 120), S=st.integers(200, 4000), world=st.integers(2, 24), seed=st.integers(0, 99))
def test_searches_skip_only_assignments_that_cannot_win(n_docs, S, world, seed):
    """The snapped search skips a candidate whose :func:`balance._heaviest_rank_floor` (of its work or its rows)
    already breaks the targets, and the balanced search a chunk count whose floor the next count's assignment
    beats; both choose the layout of the searches that assign every candidate."""
    layout = long_tail_layout(min(n_docs, S // 2), S, seed)
    work, interiors = CumulativeWork(layout), doc_interiors(layout)
    got, got_balanced = snapped_runs(work, world, interiors), balanced_runs(work, world)
    got_positions = balanced_positions(position_work(layout), world)
    with without_floors():
        want, want_balanced = snapped_runs(work, world, interiors), balanced_runs(work, world)
        want_positions = balanced_positions(position_work(layout), world)
    assert (got is None) == (want is None)
    if got is not None:
        assert got[0] == want[0] and torch.equal(got[1], want[1]) and got[2] == want[2]
    for a, b in ((got_balanced, want_balanced), (got_positions, want_positions)):
        assert a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2]


@settings(max_examples=200, deadline=None)
@given(work=st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0, 5.0, 40.0]), min_size=2, max_size=160),
       world=st.integers(2, 5))
def test_balanced_search_skips_only_chunk_counts_that_cannot_win(work, world):
    """Per-position works of any shape (spikes where a coarser chunk count balances better than a finer one): the
    balanced search that skips a count beaten by the next one's assignment chooses as the one that tries each."""
    work = torch.tensor(work, dtype=torch.float64)
    got = balanced_positions(work, world)
    with without_floors():
        want = balanced_positions(work, world)
    assert got[0] == want[0] and torch.equal(got[1], want[1]) and got[2] == want[2]


def test_the_searches_skip_assignments_at_scale():
    """At 1M tokens, 8,192 documents, CP 64 (the plan benchmark's case) the floors skip assignments of both
    searches and the layouts are the ones every assignment gives."""
    from unittest import mock

    from blockdiag_dist import balance

    layout = long_tail_layout(8192, 1 << 20, 0)
    work, interiors = CumulativeWork(layout), doc_interiors(layout)
    assigned = []

    def counting(w, world, per_rank, real=balance._assign_array):
        assigned.append(w.size)
        return real(w, world, per_rank)

    with mock.patch.object(balance, "_assign_array", counting):
        counts = []
        for search in (lambda: snapped_runs(work, 64, interiors), lambda: balanced_runs(work, 64)):
            assigned.clear()
            got = search()
            skipping = len(assigned)
            with without_floors():
                want = search()
            counts.append((skipping, len(assigned) - skipping))
            assert (got is None) == (want is None)
            if got is not None:
                assert got[0] == want[0] and torch.equal(got[1], want[1]) and got[2] == want[2]
    (snapped_with, snapped_without), (balanced_with, balanced_without) = counts
    assert snapped_with < snapped_without and balanced_with < balanced_without, counts


@SETTINGS
@given(spans=st.lists(st.tuples(st.integers(-50, 50), st.integers(0, 6)), max_size=12))
def test_interval_ranges_equal_concatenated_aranges(spans):
    """interval_ranges (one running sum of steps) is the concatenation of ``arange(s, s + n)``, empty intervals,
    negative starts and backward jumps included; so are the torch ops a device runs (torch_ranges), with and
    without the total given."""
    from blockdiag_dist.balance import torch_ranges

    starts = torch.tensor([s for s, _ in spans], dtype=torch.int64)
    lengths = torch.tensor([n for _, n in spans], dtype=torch.int64)
    want = [p for s, n in spans for p in range(s, s + n)]
    for got in (interval_ranges(starts, lengths), interval_ranges(starts, lengths, len(want)),
                torch_ranges(starts, lengths), torch_ranges(starts, lengths, len(want))):
        assert got.dtype == torch.int64 and got.tolist() == want
    with pytest.raises(ValueError, match="expected total"):  # the host checks the total a device would trust
        interval_ranges(starts, lengths, len(want) + 1)


def sequential_snap(edges, allowed, reach: int, S: int, nearest=None):
    """The oracle of ``balance._snap``: its candidates, then the repair one edge at a time, every edge walked.
    ``nearest`` (the search ``_snapped`` shares between tolerances) is ignored: the oracle searches anew."""
    x = edges[1:-1]
    best = allowed.nearest(x).tolist()
    out = [int(edges[0])]
    for xv, bv in zip(x.tolist(), best):
        if xv < S and abs(bv - xv) <= reach and bv > out[-1]:
            xv = bv
        out.append(max(xv, out[-1] + 1))
    out.append(int(edges[-1]))
    return np.array(out, dtype=np.int64)


@SETTINGS
@given(seqlens=st.lists(st.integers(1, 40), min_size=1, max_size=12), chunks=st.integers(1, 40),
       tolerance=st.sampled_from([1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16]), pad=st.integers(0, 9), world=st.integers(2, 5))
def test_snap_repair_equals_edge_by_edge(seqlens, chunks, tolerance, pad, world):
    """balance._snap (walks only the stretches where snapped edges cross) gives the edges of the edge-by-edge
    repair, for many chunks per document (edges that snap onto one boundary) and CP padding past ``S``; and
    ``snapped_runs`` chooses the same layout (runs, rows, max/mean work) with either repair."""
    from unittest import mock

    from blockdiag_dist import balance
    from blockdiag_dist.balance import _Allowed, _snap

    layout = DocLayout.from_seqlens([seqlens])
    S = layout.seq_len
    chunk_len = -(-(S + pad) // chunks)
    edges = torch.arange(chunks + 1) * chunk_len
    for allowed in (_Allowed(interiors=doc_interiors(layout)), _Allowed(bounds=doc_boundaries(layout))):
        got = _snap(edges, allowed, int(tolerance * chunk_len), S)
        assert got.tolist() == sequential_snap(edges, allowed, int(tolerance * chunk_len), S).tolist()
    work, interiors = CumulativeWork(layout), doc_interiors(layout)
    got = snapped_runs(work, world, interiors)
    with mock.patch.object(balance, "_snap", sequential_snap):
        want = snapped_runs(work, world, interiors)
    assert (got is None) == (want is None)
    if got is not None:
        assert got[0] == want[0] and torch.equal(got[1], want[1]) and got[2] == want[2]


@SETTINGS
@given(world=st.integers(1, 6), per_rank=st.sampled_from([1, 2, 4]), data=st.data())
def test_chunk_runs_equal_the_intervals_rank_by_rank(world, per_rank, data):
    """balance._chunk_runs (the shard runs of a chunk assignment, in arrays) equals ``runs_of`` of each rank's
    intervals built one chunk at a time: its chunks ascending, then its CP padding past the sequence in rank order."""
    import numpy as np

    from blockdiag_dist.balance import _chunk_runs, runs_of

    n = world * per_rank
    lens = np.array(data.draw(st.lists(st.integers(1, 5), min_size=n, max_size=n)), dtype=np.int64)
    edges = np.concatenate([[0], np.cumsum(lens)])
    perm = np.array(data.draw(st.permutations(range(n))), dtype=np.int64)
    owned = np.sort(perm.reshape(world, per_rank), 1)
    rows = lens[owned].sum(1).tolist()
    L = max(rows) + data.draw(st.integers(0, 2))
    padded_len = int(edges[-1]) + data.draw(st.integers(0, 3))
    intervals, extra = [], padded_len
    for ks, m in zip(owned.tolist(), rows):
        ivs = [(int(edges[k]), int(edges[k + 1] - edges[k])) for k in ks]
        if L > m:
            ivs.append((extra, L - m))
            extra += L - m
        intervals.append(ivs)
    assert torch.equal(_chunk_runs(owned, edges[:-1], lens, L, padded_len), runs_of(intervals))


@SETTINGS
@given(space=st.integers(1, 300), data=st.data())
def test_flat_index_rows_of_blocks_equal_id_by_id(space, data):
    """FlatIndex.rows_of (one lookup per block row where the row's ids lie in one run of the buffer) equals the
    id-by-id lookup, for rows inside a run, across runs, over absent ids, ascending, descending and clamped."""
    n = data.draw(st.integers(0, space))
    flat = torch.randperm(space, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))[:n]
    if data.draw(st.booleans()):
        flat = torch.sort(flat).values
    index = FlatIndex(flat)
    m = data.draw(st.integers(1, 9))
    lo = torch.tensor(data.draw(st.lists(st.integers(0, space - 1), min_size=1, max_size=12)))
    step = torch.tensor(data.draw(st.lists(st.sampled_from([-1, 1]), min_size=lo.numel(), max_size=lo.numel())))
    x = (lo[:, None] + step[:, None] * torch.arange(m)[None, :]).clamp(0, space - 1)
    assert torch.equal(index.rows_of(x), index[x])


class _SmallWindows(FlatIndex):
    WINDOW_FROM = 1  # every lookup of a dense enough span goes through the span's table


@SETTINGS
@given(space=st.integers(1, 300), data=st.data())
def test_flat_index_span_tables_equal_the_search(space, data):
    """FlatIndex's lookup through a table of the looked-up span (built from the runs that meet it) equals the
    search id by id (ids absent, repeated, out of order; spans inside one run and across many)."""
    n = data.draw(st.integers(0, space))
    flat = torch.randperm(space, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))[:n]
    if data.draw(st.booleans()):
        flat = torch.sort(flat).values
    x = torch.tensor(data.draw(st.lists(st.integers(0, space - 1), min_size=1, max_size=40)))
    assert torch.equal(_SmallWindows(flat)[x], FlatIndex(flat)[x])
    blocks = (x[:, None] + torch.arange(3)).clamp(max=space - 1)  # rows of 3 ids: in one run, across, absent
    assert torch.equal(_SmallWindows(flat).rows_of(blocks), FlatIndex(flat)[blocks])


@SETTINGS
@given(space=st.integers(1, 300), data=st.data())
def test_flat_index_ragged_blocks_and_ranges_equal_id_by_id(space, data):
    """FlatIndex.rows_in_blocks (blocks of any length, empty ones included: one lookup per block inside a run,
    a table of each other block's span, or a search per id where the spans are long) and rows_of_ranges (ranges
    met run by run) equal the id-by-id lookup."""
    n = data.draw(st.integers(0, space))
    flat = torch.randperm(space, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))[:n]
    if data.draw(st.booleans()):
        flat = torch.sort(flat).values
    index = FlatIndex(flat)
    first = torch.tensor(data.draw(st.lists(st.integers(0, space - 1), min_size=1, max_size=12)))
    lengths = torch.tensor([data.draw(st.integers(0, space - int(f))) for f in first.tolist()])
    ranges = interval_ranges(first, lengths)
    assert torch.equal(torch.from_numpy(index.rows_of_ranges(first.numpy(), lengths.numpy())), index[ranges])
    assert torch.equal(index.rows_in_blocks(ranges, lengths), index[ranges])
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    scattered = torch.randint(0, space, (int(lengths.sum()),), generator=gen)  # blocks of any ids, in any order
    assert torch.equal(index.rows_in_blocks(scattered, lengths), index[scattered])
    assert torch.equal(_NoSlack(flat).rows_in_blocks(scattered, lengths), index[scattered])  # a search per id


class _NoSlack(FlatIndex):
    SPAN_SLACK = 0  # blocks whose spans exceed WINDOW_SPAN times their ids are searched id by id


@settings(max_examples=200, deadline=None)
@given(ids=layouts(max_len=60), world=st.integers(1, 9), name=LAYOUT_NAMES)
@example(ids=torch.tensor([[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1]]), world=3, name="contiguous")
def test_cost_floor_is_at_most_the_modelled_cost(ids, world, name):
    """The floor ``layout="auto"`` prunes its candidates with (work, cut runs and the keys before them, read from
    the shard runs) is at most the modelled cost of the plan, on every layout, row count and rank count. The
    example: two rows whose documents' interiors touch, so the merged interior starts before the document that
    rank 1's first position is inside (one row's rule would count keys that row does not need)."""
    from blockdiag_dist.plan import _cost_floor, modelled_cost

    layout = DocLayout.from_doc_ids(ids)
    plan = plan_step(ids, world, name)
    floor = _cost_floor(CumulativeWork(layout), doc_interiors(layout), plan.shards.runs, world, layout.batch_size)
    assert max(plan.work_per_rank()) <= floor <= modelled_cost(plan)
