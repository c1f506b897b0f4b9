"""Run many cases over persistent pools (one per CP size), or in-process under torchrun; merge per-rank
results into one verdict per case."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .cases import Case
from .exchange_check import exchange_metrics
from .pool import TaskFailure, WorkerPool
from .runner import expected_results, pack_expected, run_case, summed_metrics, warm_up

__all__ = ["CaseResult", "Session"]


@dataclass
class CaseResult:
    case: Case
    status: str  # "pass" | "fail" | "error" | "timeout" | "crash"
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # worst rank per metric
    failed_metrics: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # ranks that failed (any status but pass)
    details: str = ""  # tracebacks or the failing metrics, readable
    mode: str | None = None  # the exchange the implementation chose, when it reports one
    seconds: float = 0.0
    impl: str = "blockdiag_dist"
    backends: str = ""  # the SDPA backends the baseline and the implementation ran on (below float64)

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def rel(self, name: str) -> float:
        row = self.metrics.get(name)
        if not row:
            return float("nan")
        return row["err"] / row["scale"] if row.get("scale") else row["err"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case.to_dict(), "label": self.case.label(), "status": self.status, "mode": self.mode,
            "seconds": round(self.seconds, 6), "failed_metrics": self.failed_metrics, "ranks": self.ranks,
            "metrics": self.metrics, "details": self.details, "reproduce": self.case.command(self.impl),
            "backends": self.backends,
        }


def merge_ranks(case: Case, per_rank: Sequence[dict], expected: dict, seconds: float, impl: str) -> CaseResult:
    """One verdict from every rank's metrics (a metric fails if it fails on any rank), plus the quantities
    summed over ranks, checked here against ``expected`` (unpacked tensors)."""
    metrics: dict[str, dict[str, Any]] = {}
    bad_ranks: set[int] = set()
    summed = {"metrics": {**summed_metrics(case, list(per_rank), expected), **exchange_metrics(case, per_rank)}}
    for rank, info in [*enumerate(per_rank), ("sum", summed)]:
        for name, row in info["metrics"].items():
            row = dict(row, rank=rank)
            cur = metrics.get(name)
            worse = cur is None or (cur["ok"] and not row["ok"]) or (cur["ok"] == row["ok"] and row["err"] > cur["err"])
            if worse:
                metrics[name] = row
            if not row["ok"] and rank != "sum":
                bad_ranks.add(rank)
    failed = sorted(n for n, r in metrics.items() if not r["ok"])
    details = "; ".join(
        f"{n}: err {metrics[n]['err']:.3g} > limit {metrics[n]['limit']:.3g} on rank {metrics[n]['rank']}"
        + (f" ({metrics[n]['why']})" if metrics[n].get("why") else "")
        for n in failed
    )
    modes = {info.get("mode") for info in per_rank}
    return CaseResult(
        backends=backends_used(case, expected),
        case=case, status="fail" if failed else "pass", metrics=metrics, failed_metrics=failed,
        ranks=sorted(bad_ranks), details=details, mode=modes.pop() if len(modes) == 1 else None,
        seconds=seconds, impl=impl,
    )


class Session:
    """Feeds cases to one persistent pool per CP size (spawned on first use, respawned after a failure)."""

    def __init__(
        self,
        impl: str = "blockdiag_dist",
        *,
        case_timeout: float = 60.0,
        chunk: int = 32,
        backend: str = "gloo",
        in_process: Callable[[Case], tuple[list[dict], dict]] | None = None,
    ) -> None:
        self.impl = impl
        self.case_timeout = case_timeout
        self.chunk = chunk
        self.backend = backend
        self.in_process = in_process  # torchrun: run on the launched group instead of pools
        self.pools: dict[int, WorkerPool] = {}
        self.timing: dict[int, dict[str, float]] = {}  # per CP size: seconds spent running cases, cases run

    def throughput(self) -> dict[int, float]:
        """Cases per second per CP size, measured while the pool was running cases (its start excluded)."""
        return {cp: t["cases"] / t["run"] for cp, t in sorted(self.timing.items()) if t["run"] > 0}

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()

    def pool(self, cp: int) -> WorkerPool:
        if cp not in self.pools:
            self.pools[cp] = WorkerPool(
                cp, backend=self.backend, collective_timeout=max(60.0, 2 * self.case_timeout), init=warm_up
            )
        return self.pools[cp]

    def run(
        self, cases: Iterable[Case], on_result: Callable[[CaseResult], None] | None = None, *, impl: str | None = None
    ) -> list[CaseResult]:
        """Run cases grouped by CP size (order kept within a size); call ``on_result`` after each. ``impl``
        overrides the session's module under test (the pools serve any module)."""
        by_cp: dict[int, list[Case]] = {}
        for c in cases:
            by_cp.setdefault(c.cp, []).append(c)
        results: list[CaseResult] = []
        for cp in sorted(by_cp):
            for r in self._run_cp(cp, by_cp[cp], impl or self.impl):
                results.append(r)
                if on_result:
                    on_result(r)
        return results

    def run_one(self, case: Case, *, impl: str | None = None) -> CaseResult:
        return self.run([case], impl=impl)[0]

    def _run_cp(self, cp: int, cases: list[Case], impl: str):
        if self.in_process is not None:
            for case in cases:
                t0 = time.perf_counter()
                per_rank, expected = self.in_process(case)
                yield merge_ranks(case, per_rank, expected, time.perf_counter() - t0, impl)
            return
        # The parent computes each case's reference once (not once per rank) while the workers run the
        # previous chunk.
        pool = self.pool(cp)
        timing = self.timing.setdefault(cp, {"run": 0.0, "cases": 0})
        try:
            pool.start()  # not counted in the throughput
        except Exception:  # noqa: BLE001 - reported per case below
            pass
        run_before, t_run = timing["run"], time.perf_counter()
        expected: dict[int, dict] = {}  # case index -> reference tensors (kept here for the summed checks)
        packed: dict[int, dict] = {}  # ... and as plain arrays for the workers

        def prepare(lo: int) -> None:
            for j in range(lo, min(lo + self.chunk, len(cases))):
                if j not in expected:
                    expected[j] = expected_results(cases[j])
                    packed[j] = pack_expected(expected[j])

        i = 0
        prepare(0)
        while i < len(cases):
            hi = min(i + self.chunk, len(cases))
            try:
                ids = pool.submit(run_case, [((cases[j].to_dict(), impl, packed[j]), {}) for j in range(i, hi)])
            except Exception as exc:  # noqa: BLE001 - e.g. the pool could not start: report, don't hang
                yield CaseResult(case=cases[i], status="crash", details=f"{type(exc).__name__}: {exc}", impl=impl)
                i += 1
                continue
            prepare(hi)
            t0 = time.perf_counter()
            for j, task_id in zip(range(i, hi), ids):
                item = pool.collect(task_id, timeout=self.case_timeout, name=cases[j].label())
                now = time.perf_counter()
                i = j + 1
                exp = expected.pop(j)
                packed.pop(j)
                if isinstance(item, TaskFailure):
                    yield _failure_result(cases[j], item, now - t0, impl)
                    break  # the pool was killed; the rest of the chunk goes to a fresh one
                result = merge_ranks(cases[j], item, exp, now - t0, impl)
                timing["cases"] += 1
                timing["run"] = run_before + time.perf_counter() - t_run  # accumulates over calls of run()
                yield result
                t0 = time.perf_counter()


def backends_used(case: Case, expected: dict) -> str:
    """Which SDPA backends produced the baseline, which refused, and which one the implementation ran on."""
    if not expected.get("base"):
        return ""
    refused = "".join(f"; {b} refused ({why})" for b, why in expected.get("refused", {}).items())
    how = "forced" if case.backend else "torch's choice"
    used = case.backend or expected.get("default_backend") or "an unnamed backend"
    return f"baseline on {', '.join(expected['base'])}{refused}; implementation on {used} ({how})"


def _failure_result(case: Case, failure: TaskFailure, seconds: float, impl: str) -> CaseResult:
    return CaseResult(
        case=case, status=failure.kind, ranks=failure.ranks, details=str(failure), seconds=seconds, impl=impl
    )
