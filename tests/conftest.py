"""Shared fixtures: one verifier session per test process, whose pools (one per CP size) live for the
whole run, so that torch import and process-group start are paid once per CP size, not per test; the training
tests run on the same pools."""

from __future__ import annotations

import os

import pytest
import torch

from verify.session import Session

TRAIN_TASK_TIMEOUT_S = 120.0  # per training run on every rank: a deadline for hangs, not a speed limit

# The longest tests (``pytest --durations``), started first: under xdist a long test collected late ends the run
# alone while the other workers wait. Prefixes of node ids, in the order they start.
LONG_FIRST = (
    "tests/test_gpu_check.py::test_dry_run_runs_every_step_on_cpu",
    "tests/test_hardening.py::test_float32_error_does_not_grow_with_cp_size",
    "tests/test_readme.py::test_shell_command[docs/trainer.md:run:torchrun",
    "tests/test_readme.py::test_shell_command[docs/multimodal.md:run:torchrun",
    "tests/test_verify.py::test_pool_runs_tasks_reports_failures_respawns_and_leaves_no_process",
    "tests/test_verify_coverage.py::test_cli_quick_reports_the_id_equality_leak_and_writes_coverage",
)


def pytest_collection_modifyitems(items):
    def order(item) -> int:
        return next((i for i, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)), len(LONG_FIRST))

    ids = [item.nodeid for item in items]
    for prefix in LONG_FIRST:  # a renamed test must be renamed here too
        file = prefix.split("::")[0] + "::"
        if any(i.startswith(file) for i in ids) and not any(i.startswith(prefix) for i in ids):
            raise pytest.UsageError(f"tests/conftest.py LONG_FIRST: expected a test whose id starts {prefix!r}, got none")
    items.sort(key=order)  # stable: every other test keeps its place
    if os.environ.get("BLOCKDIAG_SLOW_TESTS", "") in ("", "0"):
        for item in items:
            mark = item.get_closest_marker("slow")
            if mark is not None:
                why = mark.kwargs.get("reason", "slow")
                item.add_marker(pytest.mark.skip(reason=f"slow ({why}): BLOCKDIAG_SLOW_TESTS=1 or make test-slow runs it"))


@pytest.fixture(scope="session")
def session():
    with Session(case_timeout=60.0) as s:
        yield s


@pytest.fixture(scope="session")
def emulated_session():
    """A verifier session whose workers run blockdiag's CUDA branches on CPU tensors, through the strict
    emulations of flash-attn and flash-linear-attention (``verify.gpu.emulate``)."""
    from verify.gpu import emulate

    with Session(case_timeout=120.0, worker_init=emulate.install) as s:
        yield s


@pytest.fixture(scope="session")
def pools(session):
    """World size -> a persistent WorkerPool for training runs: the verifier session's pool of that size (spawned on
    first use, respawned after a failed task), so that training runs and the verifier's cases of one test process
    share one torch import and one process group per world size (the session's collectives wait up to twice its
    case timeout, 120 s: ``TRAIN_TASK_TIMEOUT_S``)."""
    return session.pool


def assert_pass(results):
    """Every result passed; otherwise fail with each failure's details and replay command."""
    bad = [r for r in results if not r.ok]
    if bad:
        lines = [f"{r.case.label()}: {r.status}: {r.details}\n  {r.case.command(r.impl)}" for r in bad[:10]]
        pytest.fail(f"{len(bad)} of {len(results)} cases failed:\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors in the test process: OpenMP threads only spin against the pool workers on a small machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
