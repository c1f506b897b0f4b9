"""Background ``warm``: fla's Triton kernels compiled while the first steps run.

fla's first call in a process compiles and autotunes its Triton kernels; on an H200 (2026-12-04) that took longer
than step ``mixers``' whole deadline, so no fla case was judged. The harness starts this process with the check
(on CUDA, fla installed, a step that reaches fla to come): it runs step ``mixers``' fla cases once, which fills
Triton's on-disk cache of compiled kernels, and the steps' own fla calls then load them. It judges nothing (the
steps do) and is stopped before a timed step and at the end of the check; the report gives what it compiled when.
"""

from __future__ import annotations

import os
import time

import torch

from . import emulate
from .step import StepContext

__all__ = ["run", "summarize"]


def run(ctx: StepContext) -> str:
    from .backends import BackendRecorder
    from .matrix import run_one
    from .mixers import cases, reaches_fla

    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # the steps' setting: the same kernels compiled
    ctx.data.update(fla=emulate.for_device(ctx.device), cases=[])
    device = torch.device(ctx.device)
    todo = [c for c in cases(ctx.quick) if reaches_fla(c)]
    ctx.data["planned"] = len(todo)
    ctx.save()
    t0 = time.monotonic()
    for case in todo:
        if ctx.time_left() <= 0:
            break
        t = time.monotonic()
        r = run_one(case, device, BackendRecorder())
        ctx.data["cases"].append({"label": case.label(), "seconds": round(time.monotonic() - t, 1),
                                  "after_s": round(time.monotonic() - t0, 1), "status": r.status})
        ctx.save()
    return "pass" if len(ctx.data["cases"]) == len(todo) else "incomplete"


def summarize(d: dict) -> list[str]:
    done = d.get("cases", [])
    line = f"fla {d.get('fla', '?')}: {len(done)} of {d.get('planned', '?')} fla cases run ahead of the steps"
    if done:
        line += f", the first in {done[0]['seconds']:.0f} s, all run {done[-1]['after_s']:.0f} s after the start"
    return [line]
