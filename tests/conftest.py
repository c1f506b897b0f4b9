"""Shared fixtures: one verifier session per test process, whose pools (one per CP size) live for the
whole run, so that torch import and process-group start are paid once per CP size, not per test."""

from __future__ import annotations

import pytest
import torch

from verify.session import Session


@pytest.fixture(scope="session")
def session():
    with Session(case_timeout=60.0) as s:
        yield s


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
