"""The tiny decoder trains the same at every CP size: K AdamW steps at CP 2, CP 4 and DP 2 x CP 2 give the
losses and final weights of CP 1 (one process), in float64 and float32, with and without activation
checkpointing (reentrant and non-reentrant).

One pool per world size, each used by one test item, so that pytest-xdist never spawns a pool twice.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from examples.model import CHECKPOINTING
from examples.training import (
    PARITY_RTOL,
    TrainConfig,
    TrainResult,
    build_tiny_model,
    parity,
    run_distributed,
    synthetic_batch,
    train,
)
from verify.pool import WorkerPool

STEPS = 3
VARIANTS = [(dtype, ck) for dtype in ("float64", "float32") for ck in CHECKPOINTING]
TASK_TIMEOUT_S = 120.0  # per run on every rank: a deadline for hangs, not a speed limit


def config(dtype: str, checkpointing: str | None, seed: int = 0, tail_padding: int = 0) -> TrainConfig:
    return TrainConfig(steps=STEPS, dtype=dtype, checkpointing=checkpointing, seed=seed, tail_padding=tail_padding)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: OpenMP threads only spin against the other processes on a small machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pools():
    """World size -> a persistent WorkerPool, spawned on first use, closed with the module."""
    started: dict[int, WorkerPool] = {}

    def get(world: int) -> WorkerPool:
        if world not in started:
            started[world] = WorkerPool(world, collective_timeout=TASK_TIMEOUT_S)
        return started[world]

    yield get
    for pool in started.values():
        pool.close()


@functools.lru_cache(maxsize=None)
def reference(dtype: str, checkpointing: str | None, tail_padding: int = 0) -> TrainResult:
    """CP 1 in this process."""
    cfg = config(dtype, checkpointing, tail_padding=tail_padding)
    return train(build_tiny_model(cfg), cfg)


def test_reference_trains_and_parity_sees_a_different_run():
    ref = reference("float64", None)
    assert len(set(ref.losses)) == STEPS, f"expected a different loss every step, got {ref.losses}"
    other_cfg = config("float64", None, seed=1)
    other = parity(ref, train(build_tiny_model(other_cfg), other_cfg))
    assert not other.ok("float64") and other.loss_rel > 1e-3 and other.weight_rel > 1e-3, other


def test_checkpointing_does_not_change_cp1():
    for dtype in ("float64", "float32"):
        plain = reference(dtype, None)
        for ck in ("reentrant", "non_reentrant"):
            p = parity(plain, reference(dtype, ck))
            assert p.ok(dtype), f"{dtype} checkpointing={ck}: {p}"


# S = 37 with 13 padding positions after every row (24 real at most): at CP 4 (L = 10) rank 3 holds only padding
PADDING_ONLY_RANK = [(1, 4, "float64", None, 13), (1, 4, "float32", "non_reentrant", 13)]


def test_tail_padding_leaves_the_last_cp4_rank_only_padding():
    for dtype, ck, tail in {(d, c, t) for _, _, d, c, t in PADDING_ONLY_RANK}:
        for step in range(STEPS):
            seq_ids = synthetic_batch(config(dtype, ck, tail_padding=tail), step)["_packed_seq_ids"]
            assert seq_ids.shape[1] == 37 and not seq_ids[:, 30:].any() and seq_ids[:, 20:30].any()


@pytest.mark.parametrize(
    "world, cases",
    [
        pytest.param(2, [(1, 2, dtype, ck, 0) for dtype, ck in VARIANTS], id="cp2"),
        pytest.param(
            4,
            [(dp, cp, dtype, ck, 0) for dp, cp in [(1, 4), (2, 2)] for dtype, ck in VARIANTS] + PADDING_ONLY_RANK,
            id="cp4-and-dp2xcp2",
        ),
    ],
)
def test_cp_matches_cp1(pools, world, cases):
    pool = pools(world)
    names = [f"dp{dp}xcp{cp} {dtype} checkpointing={ck} tail_padding={tail}" for dp, cp, dtype, ck, tail in cases]
    calls = [((config(dtype, ck, tail_padding=tail), dp, cp), {}) for dp, cp, dtype, ck, tail in cases]
    outcomes = list(pool.run_many(run_distributed, calls, timeout=TASK_TIMEOUT_S, names=names))
    assert len(outcomes) == len(cases) and all(isinstance(o, list) for o in outcomes), outcomes[-1]

    failures = []
    for name, (dp, cp, dtype, ck, tail), per_rank in zip(names, cases, outcomes):
        first = per_rank[0]
        for rank, r in enumerate(per_rank[1:], start=1):
            same = r.losses == first.losses and all(np.array_equal(r.weights[k], w) for k, w in first.weights.items())
            if not same:
                failures.append(f"{name}: rank {rank} ended with other losses or weights than rank 0")
        if all(mode == "local" for mode in first.modes):
            failures.append(f"{name}: no step exchanged keys across CP ranks (modes {first.modes})")
        p = parity(reference(dtype, ck, tail), first)
        if not p.ok(dtype):
            repro = f"python -m examples.demo --dp {dp} --cp {cp} --dtype {dtype} --steps {STEPS}"
            repro += (f" --checkpointing {ck}" if ck else "") + (f" --tail-padding {tail}" if tail else "")
            failures.append(f"{name}: {p} exceeds relative {PARITY_RTOL[dtype]:g}; reproduce: {repro}")
    assert not failures, "\n".join(failures)


def _reduce_with_a_missing_grad() -> dict:
    """Pool task: rank r's grad is r + 1, except that rank 1 never computed one (None)."""
    import torch.distributed as dist

    from blockdiag_dist.integrations import all_reduce_grads

    rank = dist.get_rank()
    used, unused = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    used.grad = torch.full((3,), rank + 1.0)
    if rank != 1:
        unused.grad = torch.full((2,), rank + 1.0, dtype=torch.float64)
    all_reduce_grads([used, unused], dist.group.WORLD)
    return {"used": used.grad.tolist(), "unused": unused.grad.tolist()}


def test_all_reduce_grads_sums_and_fills_a_missing_grad(pools):
    results = pools(2).run(_reduce_with_a_missing_grad, timeout=TASK_TIMEOUT_S, name="all_reduce_grads")
    assert results == [{"used": [3.0] * 3, "unused": [1.0] * 2}] * 2
