"""Pure plans of blockdiag_dist, checked rank by rank in one process against brute force from the reference
mask: shards, needed sets, per-pair routes, key buffers, kernel metadata and byte counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockdiag_dist.balance import (
    SNAP_TARGET, TARGET, CumulativeWork, balanced_positions, doc_boundaries, doc_interiors, position_work, snapped_positions,
)
from blockdiag_dist.kernels.dense import plan_dense
from blockdiag_dist.kernels.varlen import BAND_MIN, plan_varlen, size_class
from blockdiag_dist.plan import (
    LAYOUT_COST, StepPlan, _cost_floor, choose_layout, cut_pieces_per_rank, modelled_cost, plan_shards, plan_step,
)
from blockdiag_dist.sharding import shard_tensor, unshard
from blockdiag_dist.state import StepState, choose_exchange
from blockdiag_ref import DocLayout


def random_ids(seed: int, B: int, S: int) -> torch.Tensor:
    """Rows of runs with single tokens, middle padding and reused ids."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        row: list[int] = []
        while len(row) < S:
            n = int(torch.randint(1, 9, (1,), generator=g))
            row += [int(torch.randint(0, 4, (1,), generator=g))] * n
        rows.append(row[:S])
    return torch.tensor(rows)


LAYOUTS = [
    pytest.param(torch.tensor([[1] * 13]), id="one-long"),
    pytest.param(torch.tensor([[1, 1, 2, 3, 3, 3, 4, 5, 5, 6, 6, 6, 6]]), id="many-short"),
    pytest.param(torch.tensor([[1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]]), id="rank-edges-cp4"),
    pytest.param(torch.tensor([[1, 1, 0, 0, 2, 2, 2, 0, 3, 3, 1]]), id="middle-padding"),
    pytest.param(torch.tensor([[1, 1, 1], [0, 2, 2]]), id="two-rows-S<8"),
    pytest.param(random_ids(0, 2, 29), id="random-B2-S29"),
    pytest.param(random_ids(1, 1, 40), id="random-S40"),
]
WORLDS = [1, 2, 3, 4, 8]
WINDOWS = [-1, 0, 3]


def brute_needed(ids: torch.Tensor, world: int, rank: int, left: int, layout: str = "contiguous") -> set[tuple[int, int]]:
    """(row, position) of every key that a real query of ``rank`` may see and that lives on another rank."""
    shards = plan_step(ids, world, layout).shards
    padded = torch.nn.functional.pad(ids, (0, shards.padded_len - ids.shape[1]))
    mask = DocLayout.from_doc_ids(padded).materialize_mask(window_size=(left, 0))[:, 0]
    mine = set(shards.positions[rank].tolist())
    out = set()
    for b in range(ids.shape[0]):
        for q in mine:
            for p in mask[b, q].nonzero().flatten().tolist():
                if p not in mine:
                    out.add((b, p))
    return out


def allowed_pairs(ids: torch.Tensor, world: int, rank: int, left: int, layout: str = "contiguous") -> set[tuple[int, int]]:
    """(local query row b * L + l, key flat id) of every pair the rank's real queries may attend."""
    shards = plan_step(ids, world, layout).shards
    sp, L = shards.padded_len, shards.local_len
    padded = torch.nn.functional.pad(ids, (0, sp - ids.shape[1]))
    mask = DocLayout.from_doc_ids(padded).materialize_mask(window_size=(left, 0))[:, 0]
    pairs = set()
    for b in range(ids.shape[0]):
        for l, q in enumerate(shards.positions[rank].tolist()):
            for p in mask[b, q].nonzero().flatten().tolist():
                pairs.add((b * L + l, b * sp + p))
    return pairs


SHARDINGS = ["contiguous", "balanced", "auto:snapped"]


@pytest.mark.parametrize("ids", LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("left", WINDOWS)
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_needed_sets_equal_brute_force(ids, world, left, sharding):
    plan = plan_step(ids, world, sharding)
    x = plan.exchange(left)
    sp = plan.shards.padded_len
    for rank in range(world):
        got = {(f // sp, f % sp) for f in x.needed[rank].tolist()}
        assert got == brute_needed(ids, world, rank, left, sharding), f"rank {rank}"
    assert x.needed_tokens() == [len(brute_needed(ids, world, r, left, sharding)) for r in range(world)]


@pytest.mark.parametrize("ids", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_routes_deliver_exactly_what_each_rank_expects(ids, world, sharding):
    plan = plan_step(ids, world, sharding)
    x = plan.exchange(-1)
    for d in range(world):
        expected = x.recv_flat_ids(d)
        arrived = []
        for s in range(world):
            rows = x.send_rows(s, d)
            assert rows.numel() == int(x.counts[s, d])
            arrived.append(plan.local_flat_ids(s)[rows])
        assert torch.equal(torch.cat(arrived), expected), f"destination {d}"
        assert sorted(expected.tolist()) == x.needed[d].tolist()


@pytest.mark.parametrize("ids", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_halo_ok_means_every_needed_key_is_on_the_left_neighbour(ids, world):
    plan = plan_step(ids, world)
    for left in WINDOWS:
        x = plan.exchange(left)
        on_left = all(
            int(plan.shards.owner[f % plan.shards.padded_len]) == d - 1 for d in range(world) for f in x.needed[d].tolist()
        )
        assert x.halo_ok == on_left


def kernel_pairs_varlen(plan) -> list[tuple[int, int]]:
    """(local query row, key-buffer row) of every pair a varlen bucket plan computes for real queries."""
    pairs = []
    base = 0
    for b in plan.buckets:
        n, lq = b.q_index.shape
        lk = b.k_index.shape[1]
        allowed = (torch.ones(lq, lk, dtype=torch.bool).tril() if b.causal else torch.ones(lq, lk, dtype=torch.bool)) if b.mask is None else None
        for i in range(n):
            for a in range(lq):
                row = int(b.q_index[i, a])
                if int(plan.out_rows[base + i * lq + a]) != row:
                    continue  # a padded slot: its output is dropped
                m = allowed[a] if b.mask is None else b.mask[i, 0, a]
                pairs += [(row, int(b.k_index[i, c])) for c in m.nonzero().flatten().tolist()]
        base += n * lq
    return pairs


@pytest.mark.parametrize("ids", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("mode", ["allgather", "a2a"])
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_kernels_compute_exactly_the_allowed_pairs(ids, world, mode, sharding):
    plan = plan_step(ids, world, sharding)
    sp = plan.shards.padded_len
    for left in WINDOWS:
        for rank in range(world):
            state = StepState(plan, rank=rank, group=None, device=torch.device("cpu"), kv_exchange=mode, kernel="varlen")
            wp = state.window_plan(left)
            key_flat = wp.key_flat_ids
            assert len(set(key_flat.tolist())) == key_flat.numel(), "a key arrives twice"
            expected = allowed_pairs(ids, world, rank, left, sharding)
            meta = wp.kernel_meta
            for name, bucket_plan in (("maskless", meta.blocks), ("masked", meta.masked(torch.device("cpu")))):
                got = [(q, int(key_flat[k])) for q, k in kernel_pairs_varlen(bucket_plan)]
                assert len(got) == len(set(got)), f"{name}: a pair is computed twice"
                assert set(got) == expected, f"{name}: rank {rank}, window {left}"
            masked = [b for b in meta.blocks.buckets if b.mask is not None]
            assert all(left >= 0 and b.k_index.shape[1] <= BAND_MIN for b in masked), "a mask on a long piece"
            dense = plan_dense(plan.local_flat_ids(rank), key_flat, plan.segments, sp, left)
            dense_pairs = [(q, int(key_flat[k])) for q, k in dense.pairs().tolist()]
            assert len(dense_pairs) == len(set(dense_pairs)), "dense: a pair is computed twice"
            assert set(dense_pairs) == expected


@pytest.mark.parametrize("ids", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_window_bands_compute_exactly_the_allowed_pairs(ids, world, sharding):
    """Windows as causal squares plus reversed-causal bands (on every piece: band_min=0), no mask."""
    plan = plan_step(ids, world, sharding)
    for left in (1, 2, 3, 5):
        for rank in range(world):
            local, key_flat = plan.local_flat_ids(rank), plan.allgather_flat_ids()
            meta = plan_varlen(local, key_flat, plan.segments, plan.doc_starts, plan.shards.padded_len, left, band_min=0)
            assert all(b.mask is None for b in meta.blocks.buckets)
            got = [(q, int(key_flat[k])) for q, k in kernel_pairs_varlen(meta.blocks)]
            assert len(got) == len(set(got)), "a pair is computed twice"
            assert set(got) == allowed_pairs(ids, world, rank, left, sharding), f"rank {rank}, window {left}"


def test_contiguous_shards_pad_the_tail():
    s = plan_shards(5, 2)
    assert s.positions.tolist() == [[0, 1, 2], [3, 4, 5]]
    s = plan_shards(2, 4)  # S < CP: ranks 2 and 3 hold only padding
    assert s.positions.tolist() == [[0], [1], [2], [3]] and s.padded_len == 4
    assert s.owner.tolist() == [0, 1, 2, 3] and s.owner_row.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(
    "ids, world, left, mode",
    [
        pytest.param([[1] * 8], 1, -1, "local", id="cp1"),
        pytest.param([[1, 1, 2, 2, 3, 3, 4, 4]], 4, -1, "local", id="boundaries-on-rank-edges"),
        pytest.param([[1, 1, 1, 2, 2, 2, 2, 2]], 4, 1, "halo", id="window-1-needs-left-neighbour-only"),
        pytest.param([[1, 1, 1, 1, 1, 1, 2, 2]], 4, -1, "a2a", id="long-doc-needs-two-ranks"),
        pytest.param([[1] * 8], 2, -1, "halo", id="cp2-long-doc"),
    ],
)
def test_auto_exchange_choice(ids, world, left, mode):
    x = plan_step(torch.tensor(ids), world).exchange(left)
    got, reason = choose_exchange(x, "auto")
    assert got == mode, reason
    assert reason


def test_each_kind_of_exchange_decision_is_logged_once_whatever_its_counts(monkeypatch, caplog):
    """Every step states its exchange decision with its token counts; the process logs the first per window and mode
    only (the set of logged kinds stays bounded over a run whose layouts change every step)."""
    import blockdiag_dist.state as state_module

    monkeypatch.setattr(state_module, "_logged", set())
    layouts = [[[1] * 6 + [2] * 2], [[1] * 7 + [2]], [[1] * 5 + [2] * 3]]  # a long document crossing ranks, 3 lengths
    reasons = []
    with caplog.at_level("INFO", logger="blockdiag_dist"):
        for ids in layouts:
            state = StepState(plan_step(torch.tensor(ids), 4), rank=0, group=None, device=torch.device("cpu"),
                              kv_exchange="auto", kernel="varlen")
            reasons.append(state.window_plan(-1).reason)
        windowed = [state.window_plan(left).reason for left in (1, 2)]  # another window: a decision of its own
    assert len(set(reasons)) > 1, reasons  # the steps' reasons differ in their counts
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_exchange=")]
    assert logged == [f"kv_exchange=a2a (window left=-1): {reasons[0]}", f"kv_exchange=halo (window left=1): {windowed[0]}",
                      f"kv_exchange=halo (window left=2): {windowed[1]}"]
    assert len(state_module._logged) == 3


def test_halo_requested_where_it_cannot_work_names_the_ranks():
    x = plan_step(torch.tensor([[1] * 8]), 4).exchange(-1)
    with pytest.raises(ValueError, match=r"kv_exchange='halo': expected every rank's needed keys on its left neighbour, got rank 2 needing 2 tokens from rank 0"):
        choose_exchange(x, "halo")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_comm_report_counts_bytes_of_each_mode(world):
    ids = random_ids(3, 2, 37)
    plan = plan_step(ids, world)
    bpt = 2 * 2 * 4 * 2  # Hkv=2, K and V, D=4, bf16
    L = plan.shards.local_len
    for mode in ("allgather", "a2a"):
        state = StepState(plan, rank=0, group=None, device=torch.device("cpu"), kv_exchange=mode, kernel="varlen")
        rep = state.comm_report(-1, bytes_per_token=bpt)
        minimum = [len(brute_needed(ids, world, r, -1)) * bpt for r in range(world)]
        assert rep["min_recv"] == minimum
        assert rep["allgather_recv"] == [(world - 1) * 2 * L * bpt] * world
        assert rep["recv"] == (minimum if mode == "a2a" else rep["allgather_recv"])
        assert sum(rep["min_sent"]) == sum(minimum)


def test_size_classes_round_up_by_at_most_an_eighth():
    n = torch.arange(1, 5000)
    c = size_class(n)
    assert bool((c >= n).all())
    assert bool(((c - n)[n > 128] <= n[n > 128] // 8 + 1).all())
    assert bool((c[n > 1024] == n[n > 1024]).all())


def test_plans_are_identical_on_every_rank_and_fingerprinted():
    ids = random_ids(4, 2, 21)
    a, b = plan_step(ids, 4), plan_step(ids.clone(), 4)
    assert a.fingerprint() == b.fingerprint()
    assert a.exchange(2).fingerprint() == b.exchange(2).fingerprint()
    other = ids.clone()
    other[0, 5] = 0
    assert plan_step(other, 4).fingerprint() != a.fingerprint()
    assert plan_step(ids, 3).fingerprint() != a.fingerprint()


def pareto_ids(seed: int, S: int) -> torch.Tensor:
    """One row of long-tail documents: Pareto(1.2) lengths of at least 16 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < S:
        u = float(torch.rand(1, generator=g))
        lengths.append(min(S - sum(lengths), int(16 * (1 - u) ** (-1 / 1.2))))
    return DocLayout.from_seqlens(lengths).doc_ids


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("seed", range(4))
def test_balanced_layout_equalises_work_on_long_tail_rows(world, seed):
    ids = pareto_ids(seed, 8192)
    balanced, contiguous = plan_step(ids, world, "balanced"), plan_step(ids, world)
    work = balanced.work_per_rank()
    assert max(work) / (sum(work) / world) <= 1.05
    seg = DocLayout.from_doc_ids(ids).segments  # (row, start, end) per document: n (n + 1) / 2 pairs each
    lengths = seg[:, 2] - seg[:, 1]
    assert sum(work) == int((lengths * (lengths + 1) // 2).sum())
    assert balanced.real_tokens_per_rank() and max(balanced.real_tokens_per_rank()) - min(balanced.real_tokens_per_rank()) <= balanced.shards.local_len


@pytest.mark.parametrize("S", [1, 2, 5, 7, 31, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_balanced_positions_are_a_permutation_with_equal_rows(S, world):
    ids = random_ids(S, 2, S)
    shards = plan_step(ids, world, "balanced").shards
    flat = shards.positions.flatten()
    assert torch.equal(torch.sort(flat).values, torch.arange(shards.padded_len))
    assert shards.positions.shape == (world, shards.local_len) and shards.padded_len >= S
    for r in range(world):  # rows in global order, so pieces stay contiguous where they can
        assert bool((shards.positions[r][1:] > shards.positions[r][:-1]).all())


def test_balanced_is_deterministic_and_documented_example():
    ids = pareto_ids(7, 4096)
    a, b = plan_step(ids, 4, "balanced"), plan_step(ids.clone(), 4, "balanced")
    assert torch.equal(a.shards.positions, b.shards.positions)
    L, pos, imbalance = balanced_positions(position_work(DocLayout.from_seqlens([8])), 2)
    assert imbalance <= TARGET and L == 4


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_unshard_inverts_shard_for_every_rank(world, sharding):
    ids = random_ids(11, 2, 13)
    shards = plan_step(ids, world, sharding).shards
    t = torch.arange(2 * 13 * 3).view(2, 13, 3)
    parts = [shard_tensor(t, 1, -1, shards, r) for r in range(world)]
    assert torch.equal(unshard(parts, shards, 1), t)
    with pytest.raises(ValueError, match=f"expected {world} shards"):
        unshard(parts + [parts[0]], shards, 1)


def brute_work(ids: torch.Tensor, plan, left: int) -> list[int]:
    """(query, key) pairs the reference mask allows for each rank's queries."""
    mask = DocLayout.from_doc_ids(ids).materialize_mask(window_size=(left, 0))[:, 0]  # [B, S, S]
    S = ids.shape[1]
    return [int(mask[:, [p for p in plan.shards.positions[r].tolist() if p < S]].sum()) for r in range(plan.shards.world)]


def _work_matches(ids, world, layout, left) -> bool:
    plan = plan_step(ids, world, layout)
    return plan.work_per_rank(left) == brute_work(ids, plan, left)


@pytest.mark.parametrize("layout", SHARDINGS)
@pytest.mark.parametrize("left", [-1, 0, 3])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_work_per_rank_counts_the_pairs_of_the_reference_mask(layout, left, world):
    assert _work_matches(random_ids(5, 2, 37), world, layout, left)


def test_work_check_catches_work_moved_between_ranks(monkeypatch):
    """Planted change: each rank is credited its neighbour's work. The total (a sum over a permutation of the
    ranks) is unchanged; the per-rank count from the reference mask is not."""
    from blockdiag_dist.plan import StepPlan

    ids = random_ids(5, 2, 37)
    honest = plan_step(ids, 4, "balanced").work_per_rank()
    original = StepPlan.work_per_rank
    monkeypatch.setattr(StepPlan, "work_per_rank", lambda self, left=-1: (lambda w: w[1:] + w[:1])(original(self, left)))
    assert sum(plan_step(ids, 4, "balanced").work_per_rank()) == sum(honest)
    assert not _work_matches(ids, 4, "balanced", -1)


def brute_cut_pieces(plan) -> list[int]:
    """Per rank, by walking its rows: runs of one document whose first position is not the document's start."""
    seg, starts = plan.segments.view(-1, plan.shards.padded_len), plan.doc_starts.view(-1, plan.shards.padded_len)
    out = []
    for r in range(plan.shards.world):
        pos, n = plan.shards.positions[r].tolist(), 0
        for b in range(seg.shape[0]):
            for i, p in enumerate(pos):
                new_run = i == 0 or seg[b, pos[i - 1]] != seg[b, p] or pos[i - 1] != p - 1
                n += int(seg[b, p] != 0 and new_run and p > starts[b, p])
        out.append(n)
    return out


@pytest.mark.parametrize("ids", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_cut_pieces_equal_brute_force(ids, world, sharding):
    plan = plan_step(ids, world, sharding)
    assert cut_pieces_per_rank(plan) == brute_cut_pieces(plan)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("world", [2, 4, 8])
def test_snapped_layout_keeps_balance_and_cuts_fewer_documents(seed, world):
    ids = pareto_ids(seed, 8192)
    layout = DocLayout.from_doc_ids(ids)
    snapped = snapped_positions(position_work(layout), world, doc_boundaries(layout))
    assert snapped is not None
    L, positions, imbalance = snapped
    assert torch.equal(torch.sort(positions.flatten()).values, torch.arange(world * L))
    plan = plan_step(ids, world, "auto:snapped")
    work, rows = plan.work_per_rank(), (positions < 8192).sum(1).tolist()
    assert max(work) / (sum(work) / world) <= SNAP_TARGET and imbalance <= SNAP_TARGET
    assert max(rows) <= SNAP_TARGET * plan_step(ids, world, "balanced").shards.local_len
    assert sum(cut_pieces_per_rank(plan)) < sum(cut_pieces_per_rank(plan_step(ids, world, "balanced")))


def test_snapping_gives_up_on_one_long_document():
    layout = DocLayout.from_seqlens([4096])
    assert not bool(doc_boundaries(layout)[1:-1].any())
    L, positions, _ = snapped_positions(position_work(layout), 2, doc_boundaries(layout))  # unsnapped chunks
    assert L == 2048 and torch.equal(positions, plan_step(layout.doc_ids, 2, "balanced").shards.positions)


@pytest.mark.parametrize(
    "lengths, world, expected",
    [
        pytest.param([8192], 2, "balanced", id="one-long-doc-cp2"),
        pytest.param([8192], 4, "balanced", id="one-long-doc-cp4"),
        pytest.param([64] * 128, 4, "contiguous", id="equal-short-docs"),
        pytest.param([3000, 3000, 2192], 2, "snapped", id="few-docs-snap-at-a-boundary"),
    ],
)
def test_auto_layout_choice(lengths, world, expected):
    ids = DocLayout.from_seqlens(lengths).doc_ids
    plan, costs = choose_layout(DocLayout.from_doc_ids(ids), world)
    assert plan.shards.layout == f"auto:{expected}", costs
    assert torch.equal(plan_step(ids, world, "auto").shards.positions, plan.shards.positions)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("world", [2, 4])
def test_auto_layout_is_the_argmin_of_the_modelled_cost(seed, world):
    ids = pareto_ids(seed, 8192)
    plan, costs = choose_layout(DocLayout.from_doc_ids(ids), world)
    for name in ("contiguous", "snapped", "balanced"):
        forced = plan_step(ids, world, f"auto:{name}")
        work = forced.work_per_rank()
        recv = forced.exchange(-1).needed_tokens()
        brute = max(w + LAYOUT_COST["kv_token"] * r + LAYOUT_COST["cut_piece"] * c
                    for w, r, c in zip(work, recv, brute_cut_pieces(forced)))
        assert costs[forced.shards.layout[5:]] == modelled_cost(forced) == brute
    assert costs[plan.shards.layout[5:]] == min(costs.values())
    again = plan_step(ids.clone(), world, "auto")
    assert torch.equal(again.shards.positions, plan.shards.positions) and again.fingerprint() == plan.fingerprint()


def _auto_rows(seed: int) -> torch.Tensor:
    """Rows for the pruned choice: long-tail rows (balanced or snapped wins), equal short documents
    (contiguous wins) and random rows with padding and reused ids."""
    if seed % 3 == 0:
        return pareto_ids(seed, 4096)
    if seed % 3 == 1:
        return DocLayout.from_seqlens([37] * 60 + [1]).doc_ids
    return random_ids(seed, 2, 300)


@pytest.mark.parametrize("world", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("seed", range(6))
def test_work_bound_and_pruned_choice_equal_the_full_search(seed, world):
    """``plan_step(..., "auto")`` skips the candidates whose cost floor (read from the shard runs: each rank's work
    by ``CumulativeWork.per_rank``, its runs that start inside a document and the keys before them) exceeds the
    best cost found: the work is each candidate's exact work per rank, the floor is at most its modelled cost,
    and the pruned search returns the plan the search costing every candidate returns. On one rank it costs
    contiguous alone."""
    ids = _auto_rows(seed)
    layout = DocLayout.from_doc_ids(ids)
    full, costs = choose_layout(layout, world)
    pruned, some = choose_layout(layout, world, every_cost=False)
    assert pruned.shards.layout == full.shards.layout and pruned.fingerprint() == full.fingerprint()
    assert set(some) <= set(costs) and all(some[k] == costs[k] for k in some)
    if world == 1:
        assert list(some) == ["contiguous"] and len(costs) > 1, (some, costs)
    work, interiors = CumulativeWork(layout), doc_interiors(layout)
    for name in costs:
        forced = plan_step(ids, world, f"auto:{name}")
        if forced.shards.layout == f"auto:{name}":  # snapped may fall back to balanced
            assert work.per_rank(forced.shards.runs, world).tolist() == [float(w) for w in forced.work_per_rank()]
            floor = _cost_floor(work, interiors, forced.shards.runs, world, layout.batch_size)
            assert max(forced.work_per_rank()) <= floor <= costs[name] == modelled_cost(forced)
            if name not in some and world > 1:  # skipped: its floor alone exceeds the chosen cost
                assert floor > costs[full.shards.layout[5:]]
    assert plan_step(ids, world, "auto").fingerprint() == full.fingerprint()


def test_the_pruned_choice_skips_a_candidate_that_cannot_win():
    """Long-tail documents at CP 8: contiguous sharding's slowest rank alone costs more than the balanced
    layout's whole modelled step, so the pruned search never builds its pieces."""
    layout = DocLayout.from_doc_ids(pareto_ids(0, 4096))
    _, costs = choose_layout(layout, 8)
    _, some = choose_layout(layout, 8, every_cost=False)
    assert "contiguous" in costs and "contiguous" not in some, (costs, some)


@pytest.mark.parametrize("ids", LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("max_slices", [0, 64], ids=["gather", "slices"])
def test_a_rank_shard_and_padding_mask_equal_the_padded_full_row_sharded(ids, world, sharding, max_slices, monkeypatch):
    """shard_tensor takes this rank's rows alone (no padded copy of the whole row; by slices of its runs, or one
    gather past MAX_SLICES runs), and the batch function's padding_mask comes from the plan: both equal the
    definitions over the full rows, gradients included."""
    monkeypatch.setattr("blockdiag_dist.sharding.MAX_SLICES", max_slices)
    plan = plan_step(ids, world, sharding)
    shards, (B, S) = plan.shards, ids.shape
    pad = shards.padded_len - S
    x = torch.randn(B, S, 3, dtype=torch.float64, requires_grad=True)
    mrope = torch.arange(3 * B * S).view(3, B, S)
    for rank in range(world):
        rows = shards.rank_positions(rank)
        got = shard_tensor(x, 1, 0.5, shards, rank)
        want = F.pad(x, (0, 0, 0, pad), value=0.5)[:, rows]
        assert torch.equal(got, want)
        g = torch.randn_like(got)
        assert torch.equal(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])
        assert torch.equal(shard_tensor(mrope, 2, -7, shards, rank), F.pad(mrope, (0, pad), value=-7)[:, :, rows])
        assert torch.equal(shard_tensor(ids == 0, 1, True, shards, rank), F.pad(ids == 0, (0, pad), value=True)[:, rows])
        docs = StepState(plan, rank=rank, group=None, device=torch.device("cpu"), kv_exchange="a2a", kernel="varlen").docs
        assert torch.equal(docs.padding_mask, F.pad(ids == 0, (0, pad), value=True)[:, rows])
