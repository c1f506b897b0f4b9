"""Shared fixtures: one verifier session per test process, whose pools (one per CP size) live for the
whole run, so that torch import and process-group start are paid once per CP size, not per test."""

from __future__ import annotations

import pytest

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
