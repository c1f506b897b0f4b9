"""The tiny decoder trains the same at every CP size: K AdamW steps at CP 2, CP 4 and DP 2 x CP 2 give the
losses, first-step gradients and final weights of CP 1 (one process), in float64 and float32, with and without
activation checkpointing (reentrant and non-reentrant); also with a CP rank holding only padding, and with
balanced sharding.

One pool per world size (the session's ``pools`` fixture, shared with tests/test_train_recipes.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3
VARIANTS = [(dtype, ck) for dtype in ("float64", "float32") for ck in CHECKPOINTING]
TASK_TIMEOUT_S = 120.0  # per run on every rank: a deadline for hangs, not a speed limit


def config(
    dtype: str, checkpointing: str | None, seed: int = 0, tail_padding: int = 0, layout: str = "contiguous"
) -> TrainConfig:
    return TrainConfig(
        steps=STEPS, dtype=dtype, checkpointing=checkpointing, seed=seed, tail_padding=tail_padding, layout=layout
    )


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


class Case(NamedTuple):
    dp: int
    cp: int
    dtype: str
    checkpointing: str | None
    tail_padding: int = 0
    layout: str = "contiguous"

    def config(self) -> TrainConfig:
        return config(self.dtype, self.checkpointing, tail_padding=self.tail_padding, layout=self.layout)

    def name(self) -> str:
        return (
            f"dp{self.dp}xcp{self.cp} {self.dtype} checkpointing={self.checkpointing} "
            f"tail_padding={self.tail_padding} layout={self.layout}"
        )

    def command(self) -> str:
        """The demo run that reproduces this case."""
        return (
            f"python -m examples.demo --dp {self.dp} --cp {self.cp} --dtype {self.dtype} --steps {STEPS} "
            f"--tail-padding {self.tail_padding} --layout {self.layout}"
            + (f" --checkpointing {self.checkpointing}" if self.checkpointing else "")
        )


# S = 37 with 13 padding positions after every row (24 real at most): at CP 4 (L = 10) rank 3 holds only padding
PADDING_ONLY_RANK = [Case(1, 4, "float64", None, 13), Case(1, 4, "float32", "non_reentrant", 13)]
BALANCED = [Case(1, 4, "float64", "reentrant", layout="balanced"), Case(2, 2, "float32", None, layout="balanced")]


def test_tail_padding_leaves_the_last_cp4_rank_only_padding():
    for case in PADDING_ONLY_RANK:
        for step in range(STEPS):
            seq_ids = synthetic_batch(case.config(), step)["_packed_seq_ids"]
            assert seq_ids.shape[1] == 37 and not seq_ids[:, 30:].any() and seq_ids[:, 20:30].any()


@pytest.mark.parametrize(
    "world, cases",
    [
        pytest.param(2, [Case(1, 2, dtype, ck) for dtype, ck in VARIANTS], id="cp2"),
        pytest.param(
            4,
            [Case(dp, cp, dtype, ck) for dp, cp in [(1, 4), (2, 2)] for dtype, ck in VARIANTS]
            + PADDING_ONLY_RANK
            + BALANCED,
            id="cp4-dp2xcp2-padding-balanced",
        ),
    ],
)
def test_cp_matches_cp1(pools, world, cases):
    calls = [((case.config(), case.dp, case.cp), {}) for case in cases]
    names = [case.name() for case in cases]
    outcomes = list(pools(world).run_many(run_distributed, calls, timeout=TASK_TIMEOUT_S, names=names))
    assert len(outcomes) == len(cases) and all(isinstance(o, list) for o in outcomes), outcomes[-1]

    failures = []
    for case, per_rank in zip(cases, outcomes):
        first = per_rank[0]
        for rank, r in enumerate(per_rank[1:], start=1):
            same = r.losses == first.losses and all(np.array_equal(r.weights[k], w) for k, w in first.weights.items())
            if not same:
                failures.append(f"{case.name()}: rank {rank} ended with other losses or weights than rank 0")
        if all(mode == "local" for mode in first.modes):
            failures.append(f"{case.name()}: no step exchanged keys across CP ranks (modes {first.modes})")
        p = parity(reference(case.dtype, case.checkpointing, case.tail_padding), first)
        if not p.ok(case.dtype):
            failures.append(
                f"{case.name()}: {p} exceeds relative {PARITY_RTOL[case.dtype]:g}; reproduce: {case.command()}"
            )
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
