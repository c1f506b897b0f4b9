"""The parent of the GPU check: runs each step in its own process under its own deadline, and writes the
report (``report.json``, ``summary.txt``, ``logs/<step>.log`` and ``logs/warm.log`` when fla is compiled beside the
steps: at most eight files, nothing deeper than one folder) after every step, so that whatever finished is on disk
even if the whole run is cut short.

A step's process is the leader of its own process group: at its deadline the group is killed (pool workers
included) and the step is reported as ``timeout`` with what it had saved; the next step still runs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .step import BACKGROUND, INJECTIONS, STEPS

__all__ = ["DEADLINES", "TOTAL_S", "add_arguments", "main", "run_check"]

ROOT = Path(__file__).resolve().parents[2]
# seconds per step (each includes its process's start: torch and a CUDA context, a few seconds)
DEADLINES = {"env": 40.0, "matrix": 100.0, "mixers": 80.0, "multirank": 170.0, "kernels": 80.0}
TOTAL_S = 470.0  # the whole check stays under 8 minutes, starts included
MIN_STEP_S = 20.0  # a step is not started with less time than this left
TIMED_STEPS = ("kernels",)  # steps that measure speed: the background stops before them
OK = ("pass",)
# a step that ran out of time (its own deadline, or the check's) is unfinished, not failed: what it judged
# before is kept, and it fails the check only if a case it judged failed
NOT_FAILED = ("pass", "incomplete", "unsupported", "skipped", "timeout")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for report.json, summary.txt and logs/")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda if torch.cuda.is_available(), else cpu (the dry run)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the dry run's)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, in order (default: {','.join(STEPS)})")
    p.add_argument("--deadline", action="append", default=[], metavar="STEP=SECONDS",
                   help="override a step's deadline (defaults: " + ", ".join(f"{k} {v:.0f}" for k, v in DEADLINES.items()) + ")")
    p.add_argument("--total", type=float, default=TOTAL_S, help=f"seconds for the whole check (default {TOTAL_S:.0f})")
    p.add_argument("--inject", action="append", default=[], metavar="STEP=" + "|".join(INJECTIONS),
                   help="testing the harness: make STEP raise, hang or exit")


def _pairs(items: Sequence[str], what: str, values: Sequence[str] | None = None) -> dict[str, str]:
    out = {}
    for item in items:
        step, sep, value = item.partition("=")
        if not sep or step not in STEPS or (values is not None and value not in values):
            want = "|".join(values) if values else "SECONDS"
            raise ValueError(f"{what}: expected STEP={want} with STEP one of {', '.join(STEPS)}, got {item!r}")
        out[step] = value
    return out


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"--deadline: expected a positive number of seconds, got {text!r}")
    return value


def _git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "") if head.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _launch(name: str, out: Path, work: Path, device: str, quick: bool, seconds: float, inject: str | None = None):
    """Start a step (or a background module) in its own process group: ``(process, its JSON file, its log, start)``."""
    result_file, log = work / f"{name}.json", out / "logs" / f"{name}.log"
    cmd = [sys.executable, "-m", "verify.gpu", name, "--out", str(result_file), "--device", device,
           "--seconds", f"{seconds:.1f}", "--check-pid", str(os.getpid()), *(["--quick"] if quick else []),
           *(["--inject", inject] if inject else [])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.setdefault("TRITON_F32_DEFAULT", "ieee")  # float32 tl.dot in IEEE float32, not TF32 (fla; see mixers.py)
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    return proc, result_file, log, time.monotonic()


def _stop(proc: subprocess.Popen) -> None:
    try:  # the group: pool workers the step started go too
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _run_step(name: str, out: Path, work: Path, device: str, quick: bool, seconds: float, inject: str | None) -> dict:
    """One step in its own process group; its record for the report (the step's own file lives in ``work``)."""
    proc, result_file, log, t0 = _launch(name, out, work, device, quick, seconds, inject)
    try:
        proc.wait(timeout=seconds)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # the check interrupted (Ctrl-C, SIGTERM) while waiting: the step goes with it
        _stop(proc)
    return _record(out, proc, result_file, log, t0, seconds, timed_out)


def _record(out: Path, proc: subprocess.Popen, result_file: Path, log: Path, t0: float, seconds: float,
            timed_out: bool, stopped: bool = False) -> dict:
    """``stopped``: a background process the check killed before it finished (no failure of its own)."""
    record: dict = {"seconds": round(time.monotonic() - t0, 2), "deadline_s": seconds, "returncode": proc.returncode,
                    "log": str(log.relative_to(out))}
    try:
        saved = json.loads(result_file.read_text())
    except (OSError, ValueError):
        saved = {"status": None, "data": {}, "error": None}
    record["data"] = saved.get("data", {})
    if timed_out:
        record["status"] = "timeout"
        record["error"] = f"did not finish within its deadline of {seconds:.0f} s; killed (what it saved is kept)"
    elif stopped:
        record["status"] = "stopped"
    elif saved.get("status") in (None, "running"):
        record["status"] = "crash"
        record["error"] = f"the step's process exited with code {proc.returncode} before reporting"
    else:
        record["status"] = saved["status"]
        if saved.get("error"):
            record["error"] = saved["error"]
    if record["status"] not in (*OK, "stopped"):
        record["log_tail"] = _tail(log)
    return record


def _wanted(name: str, device: str, steps: Sequence[str]) -> bool:
    """``warm``: on CUDA with fla installed, before a step that reaches fla."""
    if name == "warm":
        return device == "cuda" and importlib.util.find_spec("fla") is not None and bool({"mixers", "multirank"} & set(steps))
    raise ValueError(f"background: expected one of {BACKGROUND}, got {name!r}")


def _summary_lines(report: dict) -> list[str]:
    env = report["steps"].get("env", {}).get("data", {})
    head = (f"blockdiag GPU check: {report['verdict'].upper()} in {report['wall_seconds']:.0f} s, device {report['device']}"
            f"{' (' + env['gpu'] + ')' if env.get('gpu') else ''}, torch {env.get('torch', '?')}, "
            f"{'quick sizes' if report['quick'] else 'full sizes'}; commit {report.get('commit') or 'unknown'}")
    lines = [head, f"started {report['started_utc']}; report: report.json, logs: logs/"]

    def body(name: str, rec: dict) -> list[str]:  # a step's or a background process's summary and error
        try:
            got = ["  " + ln for ln in importlib.import_module(f"verify.gpu.{name}").summarize(rec.get("data", {}))]
        except Exception as exc:  # noqa: BLE001 - a partial record may lack fields; the JSON has everything
            got = [f"  (summary unavailable: {type(exc).__name__}: {exc})"]
        return got + (["  error: " + rec["error"].strip().splitlines()[-1]] if rec.get("error") else [])

    for name, rec in report["steps"].items():
        lines.append("")
        lines.append(f"[{name}] {rec['status'].upper()} in {rec.get('seconds', 0):.1f} s (deadline {rec.get('deadline_s', 0):.0f} s)")
        lines += body(name, rec)
    for name, rec in report.get("background", {}).items():
        lines += ["", f"[{name}, beside the steps] {rec['status'].upper()}"] + body(name, rec)
    return lines


def _write(out: Path, report: dict) -> None:
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, out / "report.json")
    (out / "summary.txt").write_text("\n".join(_summary_lines(report)) + "\n")


def _verdict(records: Sequence[dict]) -> str:
    """fail: a step failed, raised or crashed, or a case a step judged failed (a timed-out step's too);
    pass: every step passed (or found its subject unsupported); incomplete otherwise."""
    if any(r["status"] not in NOT_FAILED or r.get("data", {}).get("failed_cases") for r in records):
        return "fail"
    return "pass" if all(r["status"] in ("pass", "unsupported") for r in records) else "incomplete"


def run_check(out: Path | str, *, device: str | None = None, quick: bool = False, steps: Sequence[str] = STEPS,
              deadlines: dict[str, float] | None = None, total: float = TOTAL_S,
              inject: dict[str, str] | None = None, command: str | None = None,
              background: Sequence[str] | None = None) -> int:
    """Run the check; returns the exit status (0 iff the verdict is pass). See the package docstring.
    ``background``: modules of :data:`BACKGROUND` to run beside the steps (default: those :func:`_wanted` here)."""
    import torch

    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        raise ValueError(f"steps: expected some of {', '.join(STEPS)}, got {list(steps)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: expected a CUDA device for --device cuda, got torch.cuda.is_available() == False")
    out = Path(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="blockdiag-gpu-check-"))
    limits = dict(DEADLINES, **(deadlines or {}))
    report: dict = {
        "schema": 1, "device": device, "quick": quick, "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(), "command": command,
        "total_s": total, "verdict": "running", "wall_seconds": 0.0, "steps": {},
    }
    t0 = time.monotonic()
    if background is None:
        background = [b for b in BACKGROUND if _wanted(b, device, steps)]
    started = {b: _launch(b, out, work, device, quick, total) for b in background}
    report["background"] = {}

    def stop_background() -> None:
        for b, (proc, result_file, log, t_b) in started.items():
            running = proc.poll() is None
            _stop(proc)  # what it did is kept
            report["background"][b] = _record(out, proc, result_file, log, t_b, total, False, stopped=running)
        started.clear()

    try:
        for name in steps:
            if name in TIMED_STEPS:  # nothing beside a step that measures speed
                stop_background()
            left = total - (time.monotonic() - t0)
            if left < MIN_STEP_S:
                report["steps"][name] = {"status": "skipped", "error": f"only {left:.0f} s of the check's {total:.0f} s left", "data": {}}
            else:
                report["steps"][name] = _run_step(name, out, work, device, quick, min(limits[name], left), (inject or {}).get(name))
            report["wall_seconds"] = time.monotonic() - t0
            _write(out, report)
        stop_background()
    finally:
        for proc, *_ in started.values():
            _stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    report["verdict"] = _verdict(list(report["steps"].values()))
    _write(out, report)
    print((out / "summary.txt").read_text(), end="")
    return 0 if report["verdict"] == "pass" else 1


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    """``python -m verify gpu ...`` (argv after ``gpu``, or the namespace ``verify.cli`` parsed)."""
    if isinstance(argv, argparse.Namespace):
        args, given = argv, sys.argv[1:]
    else:
        given = ["gpu", *(sys.argv[2:] if argv is None else argv)]
        p = argparse.ArgumentParser(prog="python -m verify gpu", description=sys.modules["verify.gpu"].__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(p)
        args = p.parse_args(given[1:])
    # a SIGTERM (a launcher's timeout) ends the check through run_check's cleanup, which stops every step and
    # background process it started (they also exit when the check is gone: verify.pool.watch_parent)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        deadlines = {k: _seconds(v) for k, v in _pairs(args.deadline, "--deadline").items()}
        return run_check(args.out, device=args.device, quick=args.quick, steps=[s.strip() for s in args.steps.split(",") if s.strip()],
                         deadlines=deadlines, total=args.total, inject=_pairs(args.inject, "--inject", INJECTIONS),
                         command=" ".join(["python -m verify", *map(shlex.quote, given)]))
    except ValueError as exc:
        print(f"verify gpu: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminated(signum: int, frame) -> None:
    raise SystemExit(128 + signum)
