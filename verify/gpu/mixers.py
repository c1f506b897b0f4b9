"""Step ``mixers``: the sequence mixers of hybrid models at CP 1 on the device: Gated DeltaNet (through
flash-linear-attention's ``chunk_gated_delta_rule`` when fla is installed, float32; blockdiag's own chunked
kernel in float64), Mamba2's SSD and the short causal convolution, over the verifier's named layouts.

Each case runs in this process through the verifier's mixer runner and verdicts (``verify.mixers``: the
float64 reference per document, the baseline, the same computation in the case's dtype on the same device).
fla's Triton kernels compute ``tl.dot`` of float32 inputs in TF32 by default on NVIDIA GPUs, which a float32
verdict would count as error: the step sets ``TRITON_F32_DEFAULT=ieee`` before fla is imported (the report
says so) so that float32 means float32. fla's calls are counted (on CPU, the dry run, through its strict
emulation).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..cases import Case, mixer_matrix
from ..families import SPECS
from . import emulate
from .backends import BackendRecorder
from .matrix import dtype_summary, run_one
from .step import StepContext

__all__ = ["cases", "reaches_fla", "run", "summarize"]

FIRST = ("gated_delta", "mamba2", "conv")
LAYERS = FIRST + tuple(l for l in SPECS if l not in FIRST)
DTYPES = ("float32", "float64")
QUICK_LAYOUTS = ("padding-rank", "many-short")


def cases(quick: bool) -> list[Case]:
    """The mixer matrix at CP 1 (dtypes rotating); ``quick``: two layouts, each layer in each dtype. The cases
    that reach fla come last: its first call compiles and autotunes Triton kernels (seconds to a minute), and
    a deadline that cuts it short should leave the other mixers judged."""
    out = list(mixer_matrix(cps=(1,), dtypes=DTYPES, layouts=("contiguous",), layers=LAYERS))
    if quick:
        out = [dataclasses.replace(c, dtype=dtype) for c in out if c.name in QUICK_LAYOUTS for dtype in DTYPES]
    return sorted(out, key=reaches_fla)


def reaches_fla(case: Case) -> bool:
    """Whether the case's mixer runs through fla's ``chunk_gated_delta_rule`` where fla is installed (Gated DeltaNet
    below float64). fla's first call in a process compiles and autotunes its Triton kernels: over a minute on an
    H200 (2026-12-04), so such cases run after the others (here and in step multirank)."""
    return case.layer == "gated_delta" and case.dtype != "float64"


def run(ctx: StepContext) -> str:
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    device = torch.device(ctx.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    d = ctx.data
    d.update(fla=emulate.for_device(ctx.device), triton_f32_default=os.environ.get("TRITON_F32_DEFAULT"), layers={},
             run=0, failed_cases=0)
    todo = cases(ctx.quick)
    d["planned"] = len(todo)
    results: dict[str, list] = {}
    for case in todo:
        if ctx.time_left() <= 0:
            d["stopped"] = f"step deadline near: {d['run']} of {len(todo)} cases run"
            break
        r = run_one(case, device, BackendRecorder())
        results.setdefault(f"{case.layer} {case.dtype}", []).append(r)
        d["run"] += 1
        d["failed_cases"] += not r.ok
        d["layers"] = {key: dtype_summary(key.split()[1], rs, ctx.device) for key, rs in results.items()}
        d["fla_calls"] = emulate.CALLS["chunk_gated_delta_rule"]
        ctx.save()
    if d["failed_cases"]:
        return "fail"
    return "incomplete" if "stopped" in d else "pass"


def summarize(d: dict) -> list[str]:
    lines = [f"{d.get('run', 0)} of {d.get('planned', '?')} cases run" + (f" ({d['stopped']})" if d.get("stopped") else "")
             + (f"; fla {d['fla']}: {d.get('fla_calls', 0)} calls, TRITON_F32_DEFAULT={d.get('triton_f32_default')}" if "fla" in d else "")]
    for key, s in d.get("layers", {}).items():
        lines.append(f"{key}: {s['passed']}/{s['cases']} passed; worst error / limit {s['max_err_over_limit']:.2f}")
        lines += [f"  FAILED {f['label']}: {f['details'].splitlines()[-1] if f['details'] else f['status']}\n    {f['reproduce']}"
                  for f in s["failed"]]
    return lines
