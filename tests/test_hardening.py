"""Determinism, error against CP size, and safe defaults."""

from __future__ import annotations

import json
import os
import stat

import pytest

import mp_checks
from verify.cases import GROWTH_LIMIT, Case, error_growth, growth_cases, parse_rows
from verify.pool import WorkerPool
from verify.report import write_json


@pytest.mark.parametrize("exchange", ["a2a", "allgather"])
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_two_runs_are_bitwise_identical(session, exchange, layout):
    """The same case twice on one group, then on a fresh group: outputs and every gradient bit for bit."""
    case = Case(rows=parse_rows("1x9,2x14,0x2,3x6/4x20,5x11"), cp=3, hq=4, hkv=2, dim=8, dtype="float32", seed=5,
                exchange=exchange, layout=layout).to_dict()
    pool = session.pool(3)
    first = pool.run(mp_checks.fingerprint, args=(case,), timeout=60, name="run 1")
    second = pool.run(mp_checks.fingerprint, args=(case,), timeout=60, name="run 2")
    pool.kill()  # the next run starts a new process group
    third = pool.run(mp_checks.fingerprint, args=(case,), timeout=120, name="run 3")
    assert first == second == third
    assert len(set(first)) == 3  # the ranks hold different rows


def test_float32_error_does_not_grow_with_cp_size(session):
    results = session.run(growth_cases(cps=(1, 2, 4, 8)))
    assert all(r.ok for r in results), [r.details for r in results if not r.ok]
    growth = error_growth(results)
    assert growth is not None and sorted(growth) == [1, 2, 4, 8]
    assert growth[8] <= GROWTH_LIMIT * growth[1], growth


def test_rendezvous_lives_in_a_private_temp_dir():
    pool = WorkerPool(1)
    try:
        pool.start()
        mode = stat.S_IMODE(os.stat(pool._dir).st_mode)
        assert mode == 0o700, oct(mode)
        assert os.path.dirname(pool._dir) == os.path.dirname(os.path.realpath(os.path.join(pool._dir, "..", os.path.basename(pool._dir))))
    finally:
        pool.close()
    assert pool._dir is None


def test_json_report_is_plain_data(tmp_path, session):
    results = session.run([Case(rows=parse_rows("1x5,0x2"), cp=2)])
    path = tmp_path / "r.json"
    write_json(str(path), results, 1.0, "blockdiag_dist")
    doc = json.loads(path.read_text())  # strict JSON: no NaN/Infinity literals, no pickled objects
    assert doc["results"][0]["reproduce"].startswith("python -m verify case --rows 1x5,0x2 --cp 2")
    assert doc["results"][0]["status"] == "pass"
