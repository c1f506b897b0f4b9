"""blockdiag_dist on real gloo process groups (CP 1-4): a small attention block compared with the float64
reference through the verifier's runner (outputs of real rows, padding rows exactly 0, grads of q, k, v, of
inputs_embeds through the slice and of the projection weights, loss), plus the collective-safety rules."""

from __future__ import annotations

import pytest
import torch

import mp_checks
from conftest import assert_pass
from verify.cases import Case, default_matrix, parse_rows
from verify.exchange_check import exchange_metrics, needed_from_reference
from verify.cli import applicable
from verify.runner import impl_info


@pytest.mark.parametrize(
    "cp, sharding",
    [(1, "contiguous"), (2, "contiguous"), (3, "contiguous"), (4, "contiguous"), (2, "balanced"), (3, "balanced"), (4, "balanced")],
)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_named_layouts_every_exchange_and_kernel(session, cp, sharding, dtype):
    info = impl_info("blockdiag_dist")
    cases = [c for c in default_matrix(cps=(cp,), dtypes=(dtype,), layouts=(sharding,)) if applicable(info, c)]
    assert len(cases) >= 40
    assert {c.exchange for c in cases} == {"auto", "allgather", "halo", "a2a"}
    assert {c.checkpoint for c in cases} == {"none", "reentrant", "nonreentrant"}
    assert_pass(session.run(cases))


def test_mesh_whose_group_differs_from_its_size_is_rejected(session):
    messages = session.pool(2).run(mp_checks.mesh_size_mismatch, timeout=60, name="mesh size")
    assert all("expected its process group to hold cp_mesh.size() = 4 ranks, got 2" in m for m in messages)


def test_consensus_check_names_the_disagreeing_ranks(session):
    messages = session.pool(3).run(mp_checks.consensus_mismatch, timeout=60, name="consensus")
    for m in messages:
        assert "CP plan consensus failed" in m and "ranks [0, 2] have" in m and "ranks [1] have" in m


def test_the_batch_functions_windows_are_agreed_in_one_collective(session):
    same = session.pool(3).run(mp_checks.windows_agreed_at_once, args=(False,), timeout=60, name="windows")
    assert same == [{"collectives": ["all_reduce"], "error": None}] * 3
    differ = session.pool(3).run(mp_checks.windows_agreed_at_once, args=(True,), timeout=60, name="windows differ")
    for r in differ:  # the all-gather that names the ranks runs only once the all-reduce found a mismatch
        assert r["collectives"] == ["all_reduce", "all_gather"]
        assert "CP plan consensus failed" in r["error"] and "ranks [1] have" in r["error"]
    assert "left=-1, left=2, left=4" in differ[1]["error"] and "left=-1, left=4" in differ[0]["error"]


@pytest.mark.parametrize("mode", ["allgather", "a2a"])
def test_bytes_moved_equal_the_plan(session, mode):
    """Forward moves what the plan says, backward mirrors it; what arrived from each rank is exactly the
    minimum computed from the reference mask (a2a), or every other rank's tokens (all-gather)."""
    results = session.pool(4).run(mp_checks.traffic_per_mode, args=(mode,), timeout=60, name=mode)
    ids = torch.tensor([[1] * 10 + [2] * 7 + [0] * 3])
    owner = torch.full_like(ids, -1)
    for rank, r in enumerate(results):
        for b, p in r["real_positions"]:
            owner[b, p] = rank
    needed = needed_from_reference(ids, owner, 4)
    assert int(needed.sum()) > 0
    for rank, r in enumerate(results):
        rep = r["report"]
        assert r["forward"]["recv_bytes"] == rep["recv"][rank]
        assert r["forward"]["sent_bytes"] == rep["sent"][rank]
        assert r["backward"]["recv_bytes"] == rep["sent"][rank]
        assert r["backward"]["sent_bytes"] == rep["recv"][rank]
        assert r["mode"] == mode and len(r["arrived"]) == 1
        if mode == "a2a":
            assert r["arrived"][0] == needed[:, rank].tolist()
        else:
            assert r["arrived"][0] == [0 if s == rank else 5 for s in range(4)]  # L = 5 tokens from every other rank
            assert rep["recv"][rank] == 3 * 5 * 2 * 2 * 4 * 4  # (W - 1) * L tokens * Hkv * (D + Dv) * 4 bytes


@pytest.mark.parametrize("exchange", ["a2a", "halo"])
def test_exchange_check_catches_keys_moved_beyond_the_needed_set(session, exchange):
    """Planted change: the exchange plan ignores the window (the kernel does not). Outputs and gradients stay
    right and the plan agrees with itself (recv == min_recv); only the count of what arrived against the
    reference mask fails."""
    case = Case(rows=parse_rows("1x3,2x9,0x1,3x5"), cp=3, hq=2, hkv=1, dim=3, window=1, exchange=exchange, kernel="varlen")
    honest = session.pool(3).run(mp_checks.case_with_wide_exchange, args=(case.to_dict(), False), timeout=60, name="honest")
    planted = session.pool(3).run(mp_checks.case_with_wide_exchange, args=(case.to_dict(), True), timeout=60, name="planted")
    assert exchange_metrics(case, honest)["recv_tokens_vs_needed"]["ok"]
    for info in planted:
        assert all(row["ok"] for row in info["metrics"].values()), info["metrics"]
    row = exchange_metrics(case, planted)["recv_tokens_vs_needed"]
    assert not row["ok"] and "expected" in row["why"], row


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_gather_sequence_restores_the_original_order(session, layout):
    assert all(session.pool(3).run(mp_checks.gather_restores_order, args=(layout,), timeout=60, name="gather"))


@pytest.mark.parametrize("kind", ["allgather", "a2a", "summary"])
def test_an_exchange_under_nonreentrant_checkpointing_recomputes_on_every_rank(session, kind):
    """Non-reentrant checkpointing recomputes a region when its backward first reads a tensor saved in it. A rank
    whose use of the received K/V (or summaries) saves nothing, as a rank whose rows see no key may, would reach
    the exchange's backward collective without recomputing, while the others run the recompute's forward
    collective: the exchange itself saves a tensor, so that its backward starts the recompute first on every rank.
    Each rank's gradient: (W - 1) ranks use every received value v as v * v (gradient 2 v), the last as v (1)."""
    world = 3
    grads = session.pool(world).run(mp_checks.exchange_under_nonreentrant_checkpoint, args=(kind,), timeout=60,
                                    name=f"{kind} under checkpoint")
    for rank, got in enumerate(grads):
        x = torch.arange(6, dtype=torch.float64) + 10 * rank
        assert got == (2 * (world - 1) * x + 1).tolist(), (rank, got)
