"""Step ``matrix``: the verifier's CP 1 matrix on the device, in float32 (TF32 off), bfloat16 and float16.

Every named layout, both kernels, every doc-id source (packed ids, 4-D mask, 2-D mask), with the rotation of
heads, head dims, windows and checkpointing the verifier's matrix uses. Each case runs in this process
(CP 1 needs no group) through the verifier's own runner and verdicts; per dtype the report gives the largest
errors, the tolerance entry applied, and which SDPA backends the baseline and the implementation ran.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Iterable

import torch

from .. import tolerances
from ..cases import SOURCES, Case, default_matrix
from ..runner import check_case, expected_results, impl_info, pack_expected, unpack_expected
from ..session import CaseResult, merge_ranks
from .backends import BackendRecorder
from .step import StepContext

__all__ = ["cases", "dtype_summary", "run", "summarize"]

DTYPES = ("float32", "bfloat16", "float16")
KERNELS = ("varlen", "dense")
QUICK_LAYOUTS = ("padding-rank",)
IMPL = "blockdiag_dist"
MAX_LISTED = 10  # failed cases listed per dtype (all are counted)


def cases(quick: bool) -> list[Case]:
    """The CP 1 matrix, every case once per doc-id source."""
    base = default_matrix(cps=(1,), dtypes=DTYPES, kernels=KERNELS, exchanges=(None,), layouts=(None,),
                          cover=False)
    out = [dataclasses.replace(c, source=s) for c in base for s in SOURCES]
    return [c for c in out if c.name in QUICK_LAYOUTS] if quick else out


def run_one(case: Case, device: torch.device, recorder: BackendRecorder) -> CaseResult:
    """One case in this process at CP 1; an exception is this case's error, not the step's."""
    t0 = time.perf_counter()
    try:
        with recorder.role("baseline"):
            expected = expected_results(case, device)
        with recorder.role(f"implementation {case.kernel}"):
            mine = check_case(case, impl_info(IMPL), None, 0, 1, device, pack_expected(expected))
        return merge_ranks(case, [mine], unpack_expected(pack_expected(expected)), time.perf_counter() - t0, IMPL)
    except Exception:  # noqa: BLE001 - reported with the case
        return CaseResult(case=case, status="error", details=traceback.format_exc(), seconds=time.perf_counter() - t0, impl=IMPL)


def tolerance_entry(dtype: str) -> object:
    entry = getattr(tolerances, "TOLERANCES", {}).get(dtype)
    return dataclasses.asdict(entry) if dataclasses.is_dataclass(entry) else repr(entry)


def dtype_summary(dtype: str, results: Iterable[CaseResult], device: str) -> dict:
    """Largest error per quantity (absolute, relative to its reference scale, over its limit), failures, the
    tolerance entry applied."""
    results = list(results)
    worst: dict[str, dict] = {}
    over = 0.0
    for r in results:
        for name, m in r.metrics.items():
            if m.get("exact") or "bytes" in name:
                continue
            err, limit = m.get("err", float("inf")), m.get("limit", 0.0)
            ratio = err / limit if limit > 0 else (0.0 if err == 0 else float("inf"))
            over = max(over, ratio)
            w = worst.setdefault(name, {"err": 0.0, "rel": 0.0, "err_over_limit": 0.0})
            if err >= w["err"]:
                w.update(err=err, limit=limit, baseline_err=m.get("base"), case=r.case.label())
            w["rel"] = max(w["rel"], r.rel(name))
            w["err_over_limit"] = max(w["err_over_limit"], ratio)
    bad = [r for r in results if not r.ok]
    return {
        "cases": len(results), "passed": len(results) - len(bad), "max_err_over_limit": over,
        "exact_zero_failures": sum(1 for r in results for m in r.metrics.values() if m.get("exact") and not m.get("ok")),
        "tolerance": tolerance_entry(dtype), "worst": worst,
        "sources": sorted({r.case.source for r in results}), "kernels": sorted({r.case.kernel for r in results}),
        "failed": [_failure(r, device) for r in bad[:MAX_LISTED]],
    }


def _failure(r: CaseResult, device: str) -> dict:
    replay = r.case.command(r.impl)
    if device == "cuda":  # the plain command replays on CPU; one launched rank replays on the GPU
        replay = replay.replace("python -m verify", "torchrun --nproc-per-node 1 -m verify", 1)
    return {"label": r.case.label(), "status": r.status, "details": r.details[-2000:], "reproduce": replay}


def run(ctx: StepContext) -> str:
    device = torch.device(ctx.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny cases: threads only add overhead
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ctx.data["tf32"] = {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}
    todo = cases(ctx.quick)
    ctx.data.update(planned=len(todo), run=0, dtypes={})
    ok = True
    for dtype in DTYPES:
        recorder = BackendRecorder()
        results = []
        for case in (c for c in todo if c.dtype == dtype):
            if ctx.time_left() <= 0:
                ctx.data["stopped"] = f"step deadline near: {ctx.data['run']} of {len(todo)} cases run"
                break
            results.append(run_one(case, device, recorder))
            ctx.data["run"] += 1
        if results:
            ctx.data["dtypes"][dtype] = dict(dtype_summary(dtype, results, ctx.device), sdpa_backends=recorder.counts())
            ok &= all(r.ok for r in results)
        ctx.save()
        if "stopped" in ctx.data:
            break
    if not ok:
        return "fail"
    return "incomplete" if "stopped" in ctx.data else "pass"


def summarize(d: dict) -> list[str]:
    lines = [f"{d.get('run', 0)} of {d.get('planned', '?')} cases run" + (f" ({d['stopped']})" if d.get("stopped") else "")]
    for dtype, s in d.get("dtypes", {}).items():
        impl = {}
        for role, counts in s["sdpa_backends"].items():
            if role != "baseline":
                for k, n in counts.items():
                    impl[k.split("/")[0]] = impl.get(k.split("/")[0], 0) + n
        base = {k.split("/")[0] for k in s["sdpa_backends"].get("baseline", {})}
        lines.append(
            f"{dtype}: {s['passed']}/{s['cases']} passed; worst error / limit {s['max_err_over_limit']:.2f}; "
            f"tolerance {s['tolerance']}; SDPA baseline {sorted(base)}, implementation {impl}"
        )
        lines += [f"  FAILED {f['label']}: {f['details'].splitlines()[-1] if f['details'] else f['status']}\n    {f['reproduce']}"
                  for f in s["failed"]]
    return lines
