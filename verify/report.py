"""Progress bar, final table and JSON report of a verifier run."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .session import CaseResult

__all__ = ["Reporter", "cpu_line", "make_console", "write_json"]


def make_console() -> Console:
    """A console for reports: the terminal's width on a terminal, 160 columns in logs and pipes."""
    console = Console()
    return console if console.is_terminal else Console(width=160)

OUT_METRICS = ("out",)
GRAD_METRICS = ("dq", "dk", "dv", "dinputs_embeds", "dWq", "dWk", "dWv", "dWo")


def _rel(results: Sequence[CaseResult], names: Sequence[str]) -> float:
    vals = [r.rel(n) for r in results for n in names if n in r.metrics]
    vals = [v for v in vals if not math.isnan(v)]
    return max(vals) if vals else float("nan")


class Reporter:
    """Draws a progress bar on a terminal (plain lines otherwise) and prints the summary."""

    def __init__(self, console: Console | None = None, *, full_table: bool = False) -> None:
        self.console = console or make_console()
        self.full_table = full_table

    @contextmanager
    def progress(self, total: int, label: str = "verifying"):
        if not self.console.is_terminal:
            state = {"done": 0, "failed": 0}

            def advance(result: CaseResult) -> None:
                state["done"] += 1
                state["failed"] += not result.ok
                if not result.ok:
                    self.console.print(f"FAIL {result.case.label()}: {result.status}")
                if state["done"] % 200 == 0 or state["done"] == total:
                    self.console.print(f"{label}: {state['done']}/{total} cases, {state['failed']} failed")

            yield advance
            return
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn()]
        with Progress(*columns, console=self.console, transient=False) as progress:
            task = progress.add_task(label, total=total, failed=0)
            failed = 0

            def advance(result: CaseResult) -> None:
                nonlocal failed
                failed += not result.ok
                progress.update(task, advance=1, failed=failed, description=f"{label} cp{result.case.cp}")

            yield advance

    def summary(self, results: Sequence[CaseResult], wall: float, impl: str, per_cp: dict[int, float] | None = None,
                per_kind: dict[str, dict[int, float]] | None = None, cpu: dict[int, dict[str, float]] | None = None,
                cores: int | None = None) -> None:
        """``per_cp``: cases/s per CP size; ``per_kind``: the same for the attention and the mixer cases apart;
        ``cpu``: CPU seconds per case per CP size (:meth:`verify.session.Session.cpu_per_case`), on ``cores`` cores."""
        c = self.console
        if self.full_table:
            table = Table(title=f"verify --impl {impl}: every case")
            for col in ("case", "CP", "dtype", "exchange", "max rel err out", "max rel err grads", "verdict"):
                table.add_column(col)
            for r in results:
                table.add_row(r.case.label(), str(r.case.cp), r.case.dtype, r.mode or "-", f"{_rel([r], OUT_METRICS):.2e}",
                              f"{_rel([r], GRAD_METRICS):.2e}", _verdict([r]))
            c.print(table)
        groups: dict[tuple, list[CaseResult]] = {}
        for r in results:
            groups.setdefault((r.case.name, r.case.cp, r.case.dtype), []).append(r)
        table = Table(title=f"verify --impl {impl}: {len(results)} cases by layout, CP and dtype")
        for col in ("layout", "CP", "dtype", "cases", "max rel err out", "max rel err grads", "verdict"):
            table.add_column(col, justify="right" if col in ("CP", "cases") else "left")
        for (name, cp, dtype), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
            table.add_row(name, str(cp), dtype, str(len(rs)), f"{_rel(rs, OUT_METRICS):.2e}", f"{_rel(rs, GRAD_METRICS):.2e}", _verdict(rs))
        c.print(table)
        failed = [r for r in results if not r.ok]
        for r in failed:
            c.print(f"[bold red]FAIL[/] {r.case.label()} ({r.status}, ranks {r.ranks}): {r.details.splitlines()[0] if r.details else ''}", soft_wrap=True)
            if r.status in ("error", "timeout", "crash"):
                c.print(r.details, markup=False, highlight=False, soft_wrap=True)
            c.print(f"  reproduce: {r.case.command(impl)}", markup=False, soft_wrap=True)
        by_dtype = {}
        for r in results:
            by_dtype.setdefault(r.case.dtype, []).append(r)
        worst = ", ".join(f"{d}: out {_rel(rs, OUT_METRICS):.2e}, grads {_rel(rs, GRAD_METRICS):.2e}" for d, rs in by_dtype.items())
        rate = len(results) / wall if wall > 0 else float("nan")
        verdict = "[bold green]PASS[/]" if not failed else f"[bold red]FAIL[/] ({len(failed)} failed)"
        c.print(f"{verdict}: {len(results)} cases in {wall:.1f} s ({rate:.1f} cases/s); largest relative errors: {worst}")
        if per_cp:
            def apart(cp: int) -> str:
                parts = [f"{kind} {rates[cp]:.1f}" for kind, rates in (per_kind or {}).items() if cp in rates]
                return f" ({', '.join(parts)})" if len(parts) > 1 else ""

            c.print("cases/s per CP size, pool start excluded: "
                    + ", ".join(f"CP {cp}: {r:.1f}{apart(cp)}" for cp, r in per_cp.items()), soft_wrap=True)
        if cpu:
            c.print(cpu_line(cpu, cores), markup=False, soft_wrap=True)


def cpu_line(cpu: dict[int, dict[str, float]], cores: int | None) -> str:
    """``CPU per case, pool start excluded: CP 4: ranks 4 x 6.1 ms + parent 3.4 ms = 27.8 ms (at most 71.9 cases/s on
    2 cores), ...``: what each case cost the ranks and the parent, and the rate that CPU allows ``cores`` cores. The
    ``cp + 1`` processes keep at most that many cores busy, each at most one (a rank runs on one core)."""
    def one(cp: int, t: dict[str, float]) -> str:
        total = cp * t["rank"] + t["parent"]
        busiest = max(t["rank"], t["parent"])
        rate = min(min(cores, cp + 1) / total, 1 / busiest) if cores and total > 0 and busiest > 0 else None
        bound = f" (at most {rate:.1f} cases/s on {cores} cores)" if rate is not None else ""
        return f"CP {cp}: ranks {cp} x {t['rank'] * 1e3:.1f} ms + parent {t['parent'] * 1e3:.1f} ms = {total * 1e3:.1f} ms{bound}"

    return "CPU per case, pool start excluded: " + ", ".join(one(cp, t) for cp, t in cpu.items())


def _verdict(results: Sequence[CaseResult]) -> str:
    bad = sum(not r.ok for r in results)
    return "pass" if not bad else f"FAIL {bad}"


def write_json(path: str, results: Sequence[CaseResult], wall: float, impl: str, extra: dict[str, Any] | None = None) -> None:
    doc = {
        "impl": impl,
        "cases": len(results),
        "failed": sum(not r.ok for r in results),
        "wall_seconds": round(wall, 3),
        "cases_per_second": round(len(results) / wall, 2) if wall > 0 else None,
        **(extra or {}),
        "results": [r.to_dict() for r in results],
    }
    text = json.dumps(_plain(doc), indent=1, allow_nan=False)
    if path == "-":
        sys.stdout.write(text + "\n")
    else:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # results/ is not in a fresh clone
        with open(path, "w") as f:
            f.write(text + "\n")


def _plain(obj: Any) -> Any:
    """Plain JSON data: non-finite floats become strings ("inf", "nan"), unknown objects their str()."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)
