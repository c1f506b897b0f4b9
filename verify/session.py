"""Run many cases over persistent pools (one per CP size), or in-process under torchrun; merge per-rank
results into one verdict per case."""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .case_io import failed_row_text
from .cases import Case
from .exchange_check import exchange_metrics
from .pool import PoolsByWorld, TaskFailure, WorkerPool
from .runner import compared_on_ranks, expected_results, pack_expected, run_case, summed_metrics, warm_up

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
    details = "; ".join(failed_row_text(n, metrics[n]) for n in failed)
    modes = {info.get("mode") for info in per_rank}
    return CaseResult(
        backends=backends_used(case, expected),
        case=case, status="fail" if failed else "pass", metrics=metrics, failed_metrics=failed,
        ranks=sorted(bad_ranks), details=details, mode=modes.pop() if len(modes) == 1 else None,
        seconds=seconds, impl=impl,
    )


class Session(PoolsByWorld):
    """Feeds cases to one persistent pool per CP size (spawned on first use, respawned after a failure)."""

    def __init__(
        self,
        impl: str = "blockdiag_dist",
        *,
        case_timeout: float = 60.0,
        chunk: int = 32,
        backend: str = "gloo",
        in_process: Callable[[Case], tuple[list[dict], dict]] | None = None,
        keep_after_uniform_error: bool = False,
        device: str | None = None,
        worker_init: Callable[[], None] | None = None,
    ) -> None:
        """``device``: where the pools' ranks keep their tensors (see :class:`WorkerPool`); the expected results
        are computed on the same device (a baseline is the device's own). ``worker_init``: a picklable top-level
        function every worker runs once after its warm-up (e.g. ``verify.gpu.emulate.install``)."""
        self.impl = impl
        self.worker_init = worker_init
        self.case_timeout = case_timeout
        self.chunk = chunk
        self.backend = backend
        self.device = device
        self.in_process = in_process  # torchrun: run on the launched group instead of pools
        self.keep_after_uniform_error = keep_after_uniform_error  # see WorkerPool
        super().__init__()
        # per CP size: seconds spent running cases and cases run, in all and per kind (attention, mixer); CPU
        # seconds of the ranks (summed over them) and of this process meanwhile
        self.timing: dict[int, dict[str, float]] = {}

    def throughput(self, kind: str | None = None) -> dict[int, float]:
        """Cases per second per CP size, measured while the pool was running cases (its start excluded);
        ``kind``: only the attention cases (``"attention"``) or only the mixer cases (``"mixer"``), each
        charged the time from the previous result to its own."""
        run, cases = ("run", "cases") if kind is None else (f"run_{kind}", f"cases_{kind}")
        return {cp: t[cases] / t[run] for cp, t in sorted(self.timing.items()) if t.get(run, 0) > 0}

    def cpu_per_case(self) -> dict[int, dict[str, float]]:
        """Per CP size, the CPU time one case took, in seconds, over the same span as :meth:`throughput`: ``rank``,
        one rank's process (the mean over the ranks, its collectives' threads included); ``parent``, this process
        (references, packing, merging). On CPU pools ``cp * rank + parent`` is what the cores give each case, less
        the pipes around it in the workers."""
        return {cp: {"rank": t["rank_cpu"] / (cp * t["cases"]), "parent": t["parent_cpu"] / t["cases"]}
                for cp, t in sorted(self.timing.items()) if t.get("cases", 0) > 0 and t.get("rank_cpu", 0) > 0}

    def _spawn(self, cp: int) -> WorkerPool:
        # one thread per rank: the cases' tensors are tiny, and intra-op threads on busy cores only add
        # barrier waits (a CP 1 rank with two threads ran its backward ~50x slower than the parent's)
        return WorkerPool(
            cp, backend=self.backend, collective_timeout=max(60.0, 2 * self.case_timeout),
            init=warm_up if self.worker_init is None else functools.partial(_run_all, (warm_up, self.worker_init)),
            threads_per_worker=1,
            keep_after_uniform_error=self.keep_after_uniform_error,
            device=self.device,
        )

    def run(
        self, cases: Iterable[Case], on_result: Callable[[CaseResult], None] | None = None, *, impl: str | None = None,
        reference: Callable[[Case], dict] | None = None,
    ) -> list[CaseResult]:
        """Run cases grouped by CP size (order kept within a size); call ``on_result`` after each. ``impl``
        overrides the session's module under test (the pools serve any module); ``reference`` replaces
        :func:`verify.runner.expected_results` (e.g. a reference under a third party's declared conventions)."""
        by_cp: dict[int, list[Case]] = {}
        for c in cases:
            by_cp.setdefault(c.cp, []).append(c)
        results: list[CaseResult] = []
        for cp in sorted(by_cp):
            reference = reference or functools.partial(expected_results, device=self.device or "cpu")
            for r in self._run_cp(cp, by_cp[cp], impl or self.impl, reference):
                results.append(r)
                if on_result:
                    on_result(r)
        return results

    def run_one(self, case: Case, *, impl: str | None = None, reference: Callable[[Case], dict] | None = None) -> CaseResult:
        return self.run([case], impl=impl, reference=reference)[0]

    def _run_cp(self, cp: int, cases: list[Case], impl: str, reference: Callable[[Case], dict]):
        if self.in_process is not None:
            for case in cases:
                t0 = time.perf_counter()
                per_rank, expected = self.in_process(case)
                yield merge_ranks(case, per_rank, expected, time.perf_counter() - t0, impl)
            return
        # The parent computes each case's reference once (not once per rank) while the workers run the cases
        # already submitted: up to two chunks stay queued on the workers, so they never wait for the parent
        # between chunks; the first chunk is small, so that they start at once.
        pool = self.pool(cp)
        timing = self.timing.setdefault(cp, {"run": 0.0, "cases": 0, "rank_cpu": 0.0, "parent_cpu": 0.0})
        for kind in KINDS:
            timing.setdefault(f"run_{kind}", 0.0)
            timing.setdefault(f"cases_{kind}", 0)
        run_before, t_run = timing["run"], time.perf_counter()
        parent_before, cpu_run = timing["parent_cpu"], time.process_time()
        t_last = t_run
        expected: dict[int, dict] = {}  # case index -> reference tensors (kept here for the summed checks)
        packed: dict[int, dict] = {}  # ... and as plain arrays for the workers (what they compare)
        inflight: deque[tuple[int, int]] = deque()  # (case index, task id), submitted, in order
        nxt = 0  # the next case to submit

        def prepare(lo: int, hi: int) -> None:
            for j in range(lo, hi):
                if j not in expected:
                    expected[j] = reference(cases[j])
                    packed[j] = pack_expected(expected[j], names=compared_on_ranks(cases[j]))

        while nxt < len(cases) or inflight:
            if nxt < len(cases) and len(inflight) < self.chunk:  # keep the workers' queue full
                hi = min(nxt + (min(FIRST_CHUNK, self.chunk) if nxt == 0 else self.chunk), len(cases))
                prepare(nxt, hi)
                if not pool.alive:  # a group's start (the first, or a fresh one after a failure) is left out of the span
                    w0, c0 = time.perf_counter(), time.process_time()
                    try:
                        pool.start()
                    except Exception:  # noqa: BLE001 - raised again by submit below, and reported per case
                        pass
                    waited = time.perf_counter() - w0
                    t_run, t_last, cpu_run = t_run + waited, t_last + waited, cpu_run + time.process_time() - c0
                try:
                    ids = pool.submit(run_case, [((cases[j].to_dict(), impl, packed[j]), {}) for j in range(nxt, hi)])
                except Exception as exc:  # noqa: BLE001 - e.g. the pool could not start: report, don't hang
                    yield CaseResult(case=cases[nxt], status="crash", details=f"{type(exc).__name__}: {exc}", impl=impl)
                    expected.pop(nxt, None)
                    packed.pop(nxt, None)
                    nxt += 1
                    continue
                inflight.extend(zip(range(nxt, hi), ids))
                nxt = hi
                continue
            j, task_id = inflight.popleft()
            t0 = time.perf_counter()
            item = pool.collect(task_id, timeout=self.case_timeout, name=cases[j].label())
            now = time.perf_counter()
            exp = expected.pop(j)
            packed.pop(j)
            if isinstance(item, TaskFailure):
                yield _failure_result(cases[j], item, now - t0, impl)
                if not pool.alive:  # the pool was killed: the cases queued behind go to a fresh one
                    nxt = j + 1
                    inflight.clear()
                continue
            result = merge_ranks(cases[j], item, exp, now - t0, impl)
            t_done = time.perf_counter()
            kind = _kind(cases[j])
            timing["cases"] += 1
            timing[f"cases_{kind}"] += 1
            timing[f"run_{kind}"] += t_done - t_last
            t_last = t_done
            timing["run"] = run_before + t_done - t_run  # accumulates over calls of run()
            timing["rank_cpu"] += sum(info.get("cpu_s", 0.0) for info in item)
            timing["parent_cpu"] = parent_before + time.process_time() - cpu_run
            yield result


def _run_all(fns: Sequence[Callable[[], None]]) -> None:
    """Each of ``fns`` in order (a worker's init: picklable as a partial of this top-level function)."""
    for fn in fns:
        fn()


KINDS = ("attention", "mixer")
FIRST_CHUNK = 2  # cases in the first submission: the workers start while the parent prepares the next ones


def _kind(case: Case) -> str:
    return "attention" if case.layer == "attention" else "mixer"


def backends_used(case: Case, expected: dict) -> str:
    """Which SDPA backends produced the baseline, which refused, and which one the implementation ran on."""
    if not expected.get("base"):
        return ""
    stood_in = expected.get("stood_in", {})
    refused = "".join(f"; {b} refused ({why})" + (f", stood in for by {stood_in[b]}'s" if b in stood_in else "")
                      for b, why in expected.get("refused", {}).items())
    how = "forced" if case.backend else "torch's choice"
    used = case.backend or expected.get("default_backend") or "an unnamed backend"
    on = ", ".join(f"{b} ({stood_in[b]})" if b in stood_in else b for b in expected["base"])
    return f"baseline on {on}{refused}; implementation on {used} ({how})"


def _failure_result(case: Case, failure: TaskFailure, seconds: float, impl: str) -> CaseResult:
    return CaseResult(
        case=case, status=failure.kind, ranks=failure.ranks, details=str(failure), seconds=seconds, impl=impl
    )
