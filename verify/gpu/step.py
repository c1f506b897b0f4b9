"""One step of the GPU check, in its own process: ``python -m verify.gpu NAME --out FILE ...`` (the harness
starts these).

The step writes ``FILE`` (JSON: ``status``, ``data``, ``error``) whenever it has something new, so a step
killed at its deadline still leaves what it measured. The parent (``harness``) reads it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..pool import watch_parent

__all__ = ["BACKGROUND", "INJECTIONS", "STEPS", "StepContext", "main"]

STEPS = ("env", "matrix", "mixers", "multirank", "kernels")  # modules of this package, in running order
BACKGROUND = ("warm",)  # modules run beside the steps, from the check's start (see harness.run_check)
INJECTIONS = ("raise", "hang", "exit")  # faults a test plants in a step to check the harness


@dataclass
class StepContext:
    """What a step gets: where to run, how big, until when, and where its results go."""

    device: str  # "cpu" | "cuda"
    quick: bool  # tiny sizes (the dry run)
    finish_by: float  # time.monotonic() after which a step starts no new work (its hard deadline is later)
    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    def time_left(self) -> float:
        return self.finish_by - time.monotonic()

    def save(self, status: str = "running", error: str | None = None) -> None:
        """Write the step's results so far (atomically: the parent never reads half a file)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"status": status, "data": self.data, "error": error}, indent=1, default=str))
        os.replace(tmp, self.path)


def _inject(how: str | None, name: str) -> None:
    if how == "raise":
        raise RuntimeError(f"injected failure in step {name!r}")
    if how == "hang":
        time.sleep(10**6)
    if how == "exit":
        os._exit(3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verify.gpu", description="one step of the GPU check (python -m verify gpu runs them)")
    p.add_argument("name", choices=STEPS + BACKGROUND)
    p.add_argument("--out", required=True, help="the step's JSON file")
    p.add_argument("--device", required=True, choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seconds", type=float, required=True, help="the step's hard deadline, seconds from now")
    p.add_argument("--inject", choices=INJECTIONS)
    p.add_argument("--check-pid", type=int, default=None,
                   help="the check that started this step (default: the parent process); the step exits when it is gone")
    args = p.parse_args(argv)
    # if the check is gone (killed, even by SIGKILL), so is the step; named by its pid, as a check killed before this
    # line ran leaves the step another parent
    check = os.getppid() if args.check_pid is None else args.check_pid
    threading.Thread(target=watch_parent, args=(check,), daemon=True).start()
    # keep a margin before the hard deadline for the last piece of work and the final write
    margin = min(30.0, 0.2 * args.seconds)
    ctx = StepContext(args.device, args.quick, time.monotonic() + args.seconds - margin, Path(args.out))
    ctx.save()
    try:
        _inject(args.inject, args.name)
        status = importlib.import_module(f"verify.gpu.{args.name}").run(ctx)
    except BaseException:  # noqa: BLE001 - the parent reports it; the next step still runs
        ctx.save("error", traceback.format_exc())
        return 1
    ctx.save(status)
    return 0
