"""``python -m verify conformance``: every implementation x (layout, doc-id source, CP size, dtype), one class
per cell (see :mod:`verify.classify`), written as CONFORMANCE.md and JSON.

Implementations: ours (``blockdiag_dist``) and every adapter in :data:`verify.adapters.ADAPTERS`; an adapter
that cannot run here (package missing, CUDA only) is listed as skipped with its reason. All cases run in the
verifier's persistent pools with per-case deadlines; failures are re-checked under the adapter's declared
conventions in the same pools.
"""

from __future__ import annotations

import datetime
import importlib
import json
import platform
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from .adapters import ADAPTERS, OURS, module_path
from .cases import HEADS, NAMED_LAYOUTS, SOURCES, Case
from .classify import CLASSES, Verdict, classify
from .report import _plain, make_console
from .session import CaseResult, Session

__all__ = ["conformance_cases", "main", "run_conformance", "write_markdown"]

DIMS = (4, 3, 5)
SHORT = {"pass": "pass", "contract": "contract", "unsupported": "unsupp.", "bug": "**BUG**", "crash": "crash",
         "hang": "hang"}


def conformance_cases(cps: Sequence[int] = (1, 2, 4), dtypes: Sequence[str] = ("float64", "float32"),
                      sources: Sequence[str] = SOURCES, layouts: Sequence[str] | None = None) -> list[Case]:
    """The cells: every named layout x doc-id source x CP size x dtype (no window: most third parties have
    none); heads (MHA / GQA / MQA) and head dims rotate over the cells."""
    cases, k = [], 0
    for cp in cps:
        for name, make in NAMED_LAYOUTS.items():
            if (layouts and name not in layouts) or (name == "s-lt-cp" and cp == 1):
                continue
            rows = make(cp)
            for source in sources:
                for dtype in dtypes:
                    hq, hkv = HEADS[k % len(HEADS)]
                    cases.append(Case(rows=rows, cp=cp, name=name, hq=hq, hkv=hkv, dim=DIMS[(k // 3) % len(DIMS)],
                                      dtype=dtype, seed=k, source=source))
                    k += 1
    return cases


def describe_impl(name: str) -> dict[str, Any]:
    """Version, availability and conventions of one implementation, without running it."""
    try:
        module = importlib.import_module(module_path(name))
    except ImportError as exc:
        return {"name": name, "module": module_path(name), "unavailable": f"import failed: {exc}", "version": None}
    conv = getattr(module, "CONVENTIONS", OURS)
    version = getattr(module, "VERSION", None)
    if name == "blockdiag_dist":
        version = "this repository"
    return {"name": name, "module": module_path(name), "unavailable": getattr(module, "UNAVAILABLE", None),
            "version": version, "conventions": conv.describe(), "differences": conv.differences(), "_conv": conv}


def run_conformance(impls: Sequence[str], cases: Sequence[Case], *, case_timeout: float = 60.0, console=None,
                    backend: str = "gloo") -> dict[str, Any]:
    """Run and classify every case for every available implementation; returns the plain report data."""
    out: dict[str, Any] = {"impls": {}, "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    t_all = time.perf_counter()
    with Session(case_timeout=case_timeout, backend=backend, keep_after_uniform_error=True) as session:
        for name in impls:
            info = describe_impl(name)
            conv = info.pop("_conv", OURS)
            entry = {**info, "cells": [], "counts": {c: 0 for c in CLASSES}}
            out["impls"][name] = entry
            if info["unavailable"]:
                if console:
                    console.print(f"conformance: {name}: skipped ({info['unavailable']})", markup=False)
                continue
            t0 = time.perf_counter()
            results = session.run(cases, impl=name)

            def recheck(case: Case, reference) -> CaseResult:
                return session.run_one(case, impl=name, reference=reference)

            for r in results:
                v = classify(r, conv, recheck)
                entry["counts"][v.cls] += 1
                entry["cells"].append(_cell(r, v, name))
            entry["seconds"] = round(time.perf_counter() - t0, 1)
            if console:
                counts = ", ".join(f"{c} {n}" for c, n in entry["counts"].items() if n)
                console.print(f"conformance: {name}: {len(results)} cases in {entry['seconds']} s: {counts}", markup=False)
    out["wall_seconds"] = round(time.perf_counter() - t_all, 1)
    out["environment"] = {"torch": torch.__version__, "python": platform.python_version(), "backend": backend,
                          "device": "cpu", "cases_per_impl": len(cases)}
    return out


def _cell(r: CaseResult, v: Verdict, impl: str) -> dict[str, Any]:
    c = r.case
    return {"layout": c.name, "source": c.source, "cp": c.cp, "dtype": c.dtype, "heads": f"{c.hq}:{c.hkv}",
            "dim": c.dim, "rows": c.to_dict()["rows"], "status": r.status, **v.to_dict(),
            "failed_metrics": r.failed_metrics, "reproduce": c.command(impl)}


# ---- CONFORMANCE.md -------------------------------------------------------------------------------------
def write_markdown(path: str, data: dict[str, Any]) -> None:
    env = data["environment"]
    lines = [
        "# Conformance of context-parallel attention implementations",
        "",
        f"Generated by `make conformance` (`python -m verify conformance`) on {data['started']}: torch {env['torch']}, "
        f"Python {env['python']}, {env['device']} / {env['backend']}, {env['cases_per_impl']} cases per implementation, "
        f"{data['wall_seconds']} s in all. Every class is decided by the verifier (`verify/classify.py`): "
        "**pass**; **contract** (fails against our reference, passes re-checked under the implementation's declared "
        "conventions, named); **unsupported** (a clear refusal, quoted); **bug** (wrong under its own declared "
        "conventions); **crash** (another exception or a dead rank); **hang** (deadline passed).",
        "",
        "Each case runs one small attention block (projections, attention, output projection, cross-entropy) "
        "on every rank and compares, against the float64 reference: outputs of real rows, padding rows (exactly "
        "0), grads of q, k, v, and, summed over ranks, grads of `inputs_embeds`, of the weights and the loss. "
        "Replay any case with the command shown.",
        "",
        "## Implementations",
        "",
        "| implementation | version | conventions declared by its adapter (where they differ from ours) | status |",
        "| --- | --- | --- | --- |",
    ]
    for name, e in data["impls"].items():
        diffs = ", ".join(f"`{d}`" for d in e.get("differences") or []) or "ours"
        status = f"skipped: {e['unavailable']}" if e["unavailable"] else f"{len(e['cells'])} cases, {e.get('seconds', 0)} s"
        lines.append(f"| `{name}` | {e['version'] or '-'} | {diffs} | {status} |")
    lines += ["", "Adapters' full declarations (document, padding, 4-D masks, batch rows, CP 1, dtypes, devices, "
              "layouts, windows) are in the JSON report and in each adapter's docstring (`verify/adapters/`).", "",
              "## Counts per class", "", "| implementation | " + " | ".join(CLASSES) + " |",
              "| --- | " + " | ".join("---:" for _ in CLASSES) + " |"]
    for name, e in data["impls"].items():
        if not e["unavailable"]:
            lines.append(f"| `{name}` | " + " | ".join(str(e["counts"][c]) for c in CLASSES) + " |")
    for name, e in data["impls"].items():
        if e["unavailable"]:
            continue
        lines += ["", f"## `{name}`", ""]
        notes = (e.get("conventions") or {}).get("notes") or ()
        lines += [f"- Adapter note: {n}" for n in notes] + ([""] if notes else [])
        lines += _matrix(e["cells"])
        lines += _findings(name, e)
    skipped = [(n, e) for n, e in data["impls"].items() if e["unavailable"]]
    if skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- `{n}`: {e['unavailable']}" for n, e in skipped]
    if data.get("ringmaster_state"):
        from .ringmaster_state import markdown as state_markdown

        lines += [""] + state_markdown(data["ringmaster_state"])
    if data.get("trainers"):
        from .trainers import markdown

        lines += [""] + markdown(data["trainers"])
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _matrix(cells: list[dict]) -> list[str]:
    cols = sorted({(c["cp"], c["dtype"]) for c in cells}, key=lambda t: (t[0], t[1] != "float64"))
    rows: dict[tuple[str, str], dict] = {}
    for c in cells:
        rows.setdefault((c["layout"], c["source"]), {})[(c["cp"], c["dtype"])] = c["class"]
    head = "| layout | doc ids | " + " | ".join(f"CP {cp} {dt.replace('float', 'f')}" for cp, dt in cols) + " |"
    out = [head, "| --- | --- | " + " | ".join("---" for _ in cols) + " |"]
    for (layout, source), by in rows.items():
        out.append(f"| {layout} | {source} | " + " | ".join(SHORT.get(by.get(k, ""), "-") for k in cols) + " |")
    return out


def _findings(name: str, e: dict) -> list[str]:
    cells = e["cells"]
    out: list[str] = []
    version = e["version"] or "-"
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in cells:
        if c["class"] in ("contract", "unsupported", "crash", "hang"):
            key = ", ".join(c["conventions"]) if c["class"] == "contract" else (c["message"] or c["why"])[:300]
            groups.setdefault((c["class"], key), []).append(c)
    bugs = [c for c in cells if c["class"] == "bug"]
    if not groups and not bugs:
        return ["", f"Every case passes ({len(cells)} cases)."]
    out += ["", "### Findings", ""]
    for (cls, key), cs in sorted(groups.items(), key=lambda kv: CLASSES.index(kv[0][0])):
        where = _where(cs)
        if cls == "contract":
            out.append(f"- **contract** ({len(cs)} cases; {where}): differs from ours only by `{key}`; passes re-checked "
                       f"under it. Example: `{cs[0]['reproduce']}`")
        else:
            out.append(f"- **{cls}** ({len(cs)} cases; {where}): `{key}`. Example: `{cs[0]['reproduce']}`")
    if bugs:
        metrics = Counter(m for c in bugs for m in c.get("failing") or c["failed_metrics"])
        out.append(f"- **bug** ({len(bugs)} cases; {_where(bugs)}; {name} {version}): wrong under its own declared "
                   f"conventions. Failing quantities (cases): " + ", ".join(f"{m} ({n})" for m, n in metrics.most_common())
                   + ". Every bug, with its numbers and replay command:")
        out.append("")
        for c in bugs:
            out.append(f"  - {c['layout']} / {c['source']} / CP {c['cp']} / {c['dtype']}: {c['why']}  ")
            out.append(f"    `{c['reproduce']}`")
    return out


def _where(cs: list[dict]) -> str:
    def vals(k: str) -> str:
        return ",".join(str(v) for v in sorted({c[k] for c in cs}, key=str))

    return f"CP {vals('cp')}; {vals('dtype')}; doc ids {vals('source')}; {len({c['layout'] for c in cs})} layouts"


# ---- command line ------------------------------------------------------------------------------------
def main(args) -> int:
    torch.set_num_threads(1)
    console = make_console()
    impls = [s.strip() for s in args.impls.split(",")] if args.impls else list(ADAPTERS)
    impls = [] if impls == ["none"] else impls
    trainer_rows = None
    if getattr(args, "trainers", False):
        from .trainers import trainer_rows as parse_rows

        trainer_rows = parse_rows(args.trainer_rows)  # refused before any case runs
    cps = tuple(int(c) for c in args.cp.split(","))
    dtypes = tuple(d.strip() for d in args.dtypes.split(","))
    layouts = [s.strip() for s in args.layouts.split(",")] if args.layouts else None
    cases = conformance_cases(cps, dtypes, layouts=layouts)
    console.print(f"conformance: {len(impls)} implementations x {len(cases)} cases", markup=False)
    data = run_conformance(impls, cases, case_timeout=args.case_timeout, console=console, backend=args.backend or "gloo")
    state = getattr(args, "ringmaster_state", False)
    if trainer_rows is not None or state:
        from .pool import WorkerPool
        from .trainers import CP, run_trainer_rows

        with WorkerPool(CP, collective_timeout=args.trainer_timeout, keep_after_uniform_error=True) as pool:
            if trainer_rows is not None:
                data["trainers"] = run_trainer_rows(trainer_rows, timeout=args.trainer_timeout, console=console,
                                                    pool=pool)
            if state:
                from .ringmaster_state import run_state_rows

                data["ringmaster_state"] = run_state_rows(pool, timeout=args.trainer_timeout, console=console)
    if args.json:
        import os

        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            f.write(json.dumps(_plain(data), indent=1, allow_nan=False) + "\n")
    if args.md:
        write_markdown(args.md, data)
    return _exit_status(data, console)


def _exit_status(data: dict[str, Any], console) -> int:
    """Print the one-line summary; 1 when our own implementation failed a case (third parties never fail it)."""
    console.print(f"conformance: {data['wall_seconds']} s; " + "; ".join(
        f"{n}: " + (", ".join(f"{c} {k}" for c, k in e["counts"].items() if k) if not e["unavailable"] else "skipped")
        for n, e in data["impls"].items()), markup=False)
    ours = data["impls"].get("blockdiag_dist")
    ours_trainers = [r for r in (data.get("trainers") or {}).get("rows", []) if r["path"].startswith("blockdiag-")]
    if ours_trainers:
        console.print("trainers: " + "; ".join(f"{r['path']} {r['model']}: {r['cls']}" for r in data["trainers"]["rows"]),
                      markup=False)
    failed = ours and not ours["unavailable"] and ours["counts"]["pass"] != len(ours["cells"])
    return 1 if failed or any(r["cls"] != "pass" for r in ours_trainers) else 0
