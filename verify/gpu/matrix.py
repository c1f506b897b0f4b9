"""Step ``matrix``: the verifier's CP 1 attention cases on the device, in float32 (TF32 off), bfloat16 and float16.

First, head dims 64 and 128 (what models use: on CUDA the fused masked SDPA backends and flash-attn run them)
over the layouts with padding, both kernels, windows and a soft-cap; then the verifier's own CP 1 matrix (every
named layout, both kernels, every doc-id source, with the rotation of heads, head dims 3-5, windows and
checkpointing the verifier uses: small, so fp16/bf16 masked calls run on the MATH backend there). Each case
runs in this process (CP 1 needs no group) through the verifier's own runner and verdicts, the baseline on the
same device; per dtype the report gives the largest errors, the tolerance entry applied, which SDPA backends
the baseline and the implementation ran, and how many query rows reached SDPA fully masked (none expected).
flash-attn's calls are counted (on CPU, the dry run, through its strict emulation).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Iterable

import torch

from .. import tolerances
from ..cases import NAMED_LAYOUTS, SOURCES, Case, default_matrix
from ..runner import check_case, expected_results, impl_info, pack_expected, unpack_expected
from ..session import CaseResult, merge_ranks
from . import emulate
from .backends import BackendRecorder
from .step import StepContext

__all__ = ["cases", "dtype_summary", "run", "summarize", "wide_cases"]

DTYPES = ("float32", "bfloat16", "float16")
KERNELS = ("varlen", "dense")
# --quick: documents of several tokens between padding (at CP 1 `padding-rank` is one token and padding, where each
# kernel returns the token's value with no kernel call: the quick matrix would reach no SDPA backend)
QUICK_LAYOUTS = ("middle-padding",)
WIDE_DIMS = (64, 128)
WIDE_LAYOUTS = ("middle-padding", "padding-rank", "many-short", "two-rows", "one-long")  # --quick: the first
IMPL = "blockdiag_dist"
MAX_LISTED = 10  # failed cases listed per dtype (all are counted)


def wide_cases(quick: bool) -> list[Case]:
    """Head dims 64 and 128, 8 query heads on 2 key heads, windows and a soft-cap rotating."""
    out, k = [], 0
    for dim in WIDE_DIMS:
        for name in WIDE_LAYOUTS[:1] if quick else WIDE_LAYOUTS:
            for kernel in KERNELS:
                for dtype in DTYPES:
                    out.append(Case(rows=NAMED_LAYOUTS[name](1), cp=1, name=name, hq=8, hkv=2, dim=dim, kernel=kernel, dtype=dtype,
                                    window=(-1, 8, -1)[k % 3], softcap=(0.0, 0.0, 0.0, 30.0)[k % 4], seed=k))
                    k += 1
    return out


def cases(quick: bool) -> list[Case]:
    """The wide cases, then the CP 1 matrix, every case of it once per doc-id source."""
    base = default_matrix(cps=(1,), dtypes=DTYPES, kernels=KERNELS, exchanges=(None,), layouts=(None,),
                          cover=False)
    out = [dataclasses.replace(c, source=s) for c in base for s in SOURCES]
    return wide_cases(quick) + ([c for c in out if c.name in QUICK_LAYOUTS] if quick else out)


def run_one(case: Case, device: torch.device, recorder: BackendRecorder) -> CaseResult:
    """One case in this process at CP 1; an exception is this case's error, not the step's."""
    t0 = time.perf_counter()
    try:
        with recorder.role("baseline"):
            expected = expected_results(case, device)
        with recorder.role(f"implementation {case.kernel or case.layer}"):
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
    ctx.data["flash_attn"] = emulate.for_device(ctx.device)
    todo = cases(ctx.quick)
    ctx.data.update(planned=len(todo), run=0, failed_cases=0, dtypes={})
    results: dict[str, list[CaseResult]] = {d: [] for d in DTYPES}
    recorders = {d: BackendRecorder(ctx.device) for d in DTYPES}  # a baseline stood in for on the CPU: "... on cpu"
    for case in todo:
        if ctx.time_left() <= 0:
            ctx.data["stopped"] = f"step deadline near: {ctx.data['run']} of {len(todo)} cases run"
            break
        r = run_one(case, device, recorders[case.dtype])
        results[case.dtype].append(r)
        ctx.data["run"] += 1
        ctx.data["failed_cases"] += not r.ok
        if ctx.data["run"] % 8 == 0 or ctx.data["run"] == len(todo):
            _save(ctx, results, recorders)
    _save(ctx, results, recorders)
    if ctx.data["failed_cases"]:
        return "fail"
    return "incomplete" if "stopped" in ctx.data else "pass"


def _save(ctx: StepContext, results: dict[str, list[CaseResult]], recorders: dict[str, BackendRecorder]) -> None:
    for dtype, rs in results.items():
        if rs:
            counts = recorders[dtype].counts()
            ctx.data["dtypes"][dtype] = dict(dtype_summary(dtype, rs, ctx.device), sdpa_backends=counts,
                                             fully_masked_rows={role: c.get("fully masked rows", 0) for role, c in counts.items()})
    ctx.data["flash_calls"] = emulate.CALLS["flash_attn_varlen_func"]
    ctx.save()


def summarize(d: dict) -> list[str]:
    lines = [f"{d.get('run', 0)} of {d.get('planned', '?')} cases run" + (f" ({d['stopped']})" if d.get("stopped") else "")
             + (f"; flash-attn {d['flash_attn']}: {d.get('flash_calls', 0)} calls" if "flash_attn" in d else "")]
    for dtype, s in d.get("dtypes", {}).items():
        impl = {}
        for role, counts in s["sdpa_backends"].items():
            if role != "baseline":
                for k, n in counts.items():
                    if "/" in k:
                        impl[k.split("/")[0]] = impl.get(k.split("/")[0], 0) + n
        base = {k.split("/")[0] for k in s["sdpa_backends"].get("baseline", {}) if "/" in k}
        masked = sum(s.get("fully_masked_rows", {}).values())
        lines.append(
            f"{dtype}: {s['passed']}/{s['cases']} passed; worst error / limit {s['max_err_over_limit']:.2f}; "
            f"tolerance {s['tolerance']}; SDPA baseline {sorted(base)}, implementation {impl}"
            + (f"; {masked} query rows reached SDPA fully masked" if masked else "")
        )
        lines += [f"  FAILED {f['label']}: {f['details'].splitlines()[-1] if f['details'] else f['status']}\n    {f['reproduce']}"
                  for f in s["failed"]]
    return lines
