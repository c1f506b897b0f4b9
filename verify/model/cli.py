"""``python -m verify model``: judge a whole model's training step under CP.

    python -m verify model --model llama --cp 1,2                      (a preset: always tiny)
    python -m verify model --model qwen3_next --tiny --cp 1,2          (a transformers model type, shrunk)
    python -m verify model --model path/to/config.json --tiny --layouts spans-every-rank
    python -m verify model --presets --allow-unsupported --md MODELS.md --json results/models.json
    python -m verify model --model llama --impl verify.mutants.off_by_one
    python -m verify model --catalogue --cp 1,2 --md docs/models.md --json results/catalogue.json

Exit status: 0 iff every case passed (with ``--allow-unsupported``: or was refused, or cannot run here);
1 otherwise; 2 for a usage error (an unknown model, a config that does not build, ``--tiny`` on a config without
the fields it shrinks, an unknown layout or implementation). ``--catalogue`` (:mod:`verify.model.catalogue`):
0 unless some model is wrong, crashed or hung.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from typing import Any

from ..argtext import csv_list

__all__ = ["add_arguments", "clip", "main", "report_result"]

# Where a refusal's reader finds what is planned and how to extend it, by the refusal's exception
GUIDES = {
    "UnsupportedLayerError": "what is planned: docs/hybrid.md#what-is-not-here-yet; how to add a mixer: "
                             "docs/hybrid.md#adding-a-recurrence-the-extension-point (a layer your code computes per "
                             "document: declare_per_document)",
    "UnsupportedAttentionError": "what is carried and what stays refused, and why: "
                                 "docs/attention-variants.md#what-stays-refused-and-why",
}
REFUSED = ("unsupported", "unavailable")  # classes whose message is the same for many cases: printed once
CELL = 110  # characters of a table cell quoting a message


def clip(text: str, width: int = CELL) -> str:
    """``text`` cut at a word boundary to at most ``width`` characters, '...' marking the cut."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text[: width - 3].rsplit(" ", 1)[0].rstrip(" ,;:")
    return cut + "..."


def guide(message: str) -> str | None:
    """The doc pages for a refusal's exception (``message`` starts with its name), or None."""
    return GUIDES.get(message.split(":", 1)[0].strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .layouts import DEFAULT_LAYOUTS, MODEL_LAYOUTS
    from .zoo import PRESETS

    p.add_argument("--model", default=None, help="a preset (" + ", ".join(PRESETS) + "), a transformers model type or a "
                   "path to a config.json (comma-separated for several)")
    p.add_argument("--presets", nargs="?", const="all", default=None,
                   help="run the presets (all, or a comma-separated list)")
    p.add_argument("--tiny", action="store_true", help="shrink widths and depth, keeping every layer type (presets are always tiny)")
    p.add_argument("--cp", default="1,2", help="CP sizes (comma-separated)")
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS),
                   help="document layouts: " + ", ".join(MODEL_LAYOUTS) + " (or 'all')")
    p.add_argument("--dtypes", default="float64,float32")
    p.add_argument("--sources", default=None, help="how the documents reach the batch function: packed (_packed_seq_ids), "
                   "positions (restarting position_ids), mask4d (default: each the implementation declares; a "
                   "vision-language model: packed); every layout meets each at every CP size")
    p.add_argument("--sharding", default=None, help="sharding layouts of the implementation: contiguous, balanced, auto "
                   "(default: contiguous, where the implementation offers a choice)")
    p.add_argument("--impl", default="blockdiag_dist", help="module under test, or an adapter name")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokens")
    p.add_argument("--exact", action="store_true", help="every op in float64 (the truth's and the step's): no float32 "
                   "rounding of norms, rotary or routers, float64 limits (1e-10)")
    p.add_argument("--case-timeout", type=float, default=180.0, help="deadline of one case, seconds")
    p.add_argument("--backend", default=None, help="gloo (default)")
    p.add_argument("--allow-unsupported", action="store_true",
                   help="exit 0 when every case passed, was refused or cannot run here (the preset list)")
    p.add_argument("--json", metavar="PATH", help="write every case's result ('-' = stdout)")
    p.add_argument("--md", metavar="PATH", help="write the Markdown table (MODELS.md; with --catalogue docs/models.md)")
    g = p.add_argument_group("catalogue", "--catalogue: every causal-LM and image-text-to-text model type of the "
                             "installed transformers, tiny, float64, one layout, classed (verify/model/catalogue.py)")
    g.add_argument("--catalogue", action="store_true", help="sweep the whole catalogue (takes --cp, --md, --json, --seed)")
    g.add_argument("--only", default=None, help="with --catalogue: only these model types (comma-separated)")
    g.add_argument("--update", action="store_true",
                   help="with --catalogue --only: re-run those types and merge them into the results of --json "
                        "(an earlier sweep at the same CP sizes), rewriting --json and --md from every type")
    g.add_argument("--jobs", type=int, default=1, help="with --catalogue: sweep processes side by side")
    g.add_argument("--chunk", type=int, default=40, help="with --catalogue: models per sweep process")
    g.add_argument("--model-timeout", type=float, default=600.0, help="with --catalogue: deadline of one model, seconds")
    g.add_argument("--workdir", default=None, help="with --catalogue: journals and logs (default results/catalogue)")


def _usage(console, message: str) -> int:
    console.print(f"verify model: {message}", markup=False, soft_wrap=True)
    return 2


def main(args: argparse.Namespace, session=None) -> int:
    """Run ``python -m verify model`` with parsed ``args``; ``session`` (a
    :class:`~verify.model.run.ModelSession`) reuses its pools instead of spawning new ones."""
    import torch

    from ..report import _plain, make_console
    from ..runner import impl_info
    from .check import ModelCase
    from .layouts import MODEL_LAYOUTS, MODEL_SOURCES, TEXT_ONLY_SOURCES, covering, model_coverage
    from .run import ModelSession, model_info
    from .zoo import PRESETS, resolve

    if getattr(args, "catalogue", False):
        from .catalogue import main as catalogue_main

        if args.model or args.presets:
            return _usage(make_console(), "--catalogue: expected no --model or --presets, got "
                          + ("--model" if args.model else "--presets"))
        return catalogue_main(args)
    console = make_console()
    if bool(args.model) == bool(args.presets):
        return _usage(console, "expected exactly one of --model NAME or --presets, got "
                      + ("both" if args.model else "neither"))
    names = csv_list(args.model) if args.model else (list(PRESETS) if args.presets == "all" else csv_list(args.presets))
    if args.presets and args.presets != "all":
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            return _usage(console, f"--presets: expected names among {', '.join(PRESETS)}, got {', '.join(unknown)}")
    try:
        cps = [int(c) for c in csv_list(args.cp)]
        if not cps or min(cps) < 1:
            raise ValueError
    except ValueError:
        return _usage(console, f"--cp: expected CP sizes >= 1 like 1,2,4, got {args.cp!r}")
    layouts = list(MODEL_LAYOUTS) if args.layouts == "all" else csv_list(args.layouts)
    bad = [x for x in layouts if x not in MODEL_LAYOUTS]
    if bad or not layouts:
        return _usage(console, f"--layouts: expected names among {', '.join(MODEL_LAYOUTS)}, got {', '.join(bad) or 'none'}")
    dtypes = csv_list(args.dtypes)
    bad = [d for d in dtypes if d not in ("float64", "float32")]
    if bad or not dtypes:
        return _usage(console, f"--dtypes: expected float64 and/or float32 (CPU), got {', '.join(bad) or 'none'}")
    try:
        impl = impl_info(args.impl)
    except (ImportError, ValueError) as exc:
        return _usage(console, f"cannot use --impl {args.impl}: {exc}")
    declared = [x for x in MODEL_SOURCES if x in impl.sources]
    sources = csv_list(args.sources) if args.sources else declared
    bad = [x for x in sources if x not in MODEL_SOURCES]
    if bad or not sources:
        return _usage(console, f"--sources: expected names among {', '.join(MODEL_SOURCES)}, got {', '.join(bad) or 'none'}")
    undeclared = [x for x in sources if x not in impl.sources]
    if undeclared:
        return _usage(console, f"--sources: expected sources {args.impl} declares ({', '.join(declared) or 'none'}), "
                      f"got {', '.join(undeclared)}")
    shardings: list[str | None] = [None]
    if "layout" in impl.options:
        shardings = csv_list(args.sharding) if args.sharding else ["contiguous"]
        from blockdiag_dist.options import resolve_layout

        try:
            for s in shardings:
                resolve_layout(s)
        except ValueError as exc:
            return _usage(console, f"--sharding: {exc}")
    elif args.sharding:
        return _usage(console, f"--sharding: expected an implementation with a layout option, got {args.impl} without one")
    torch.set_num_threads(1)  # the parent computes references beside busy workers
    prepared = {}
    for name in names:
        try:
            prepared[name] = resolve(name, tiny=args.tiny)
        except ValueError as exc:  # ModelSpecError, TinyConfigError
            return _usage(console, str(exc))
    model_sources = {name: [x for x in sources if not (prepared[name].multimodal and x in TEXT_ONLY_SOURCES)] for name in names}
    empty = [name for name in names if not model_sources[name]]
    if empty:
        return _usage(console, f"--sources: expected packed for the vision-language model(s) {', '.join(empty)}, got "
                      f"{', '.join(sources)}")
    cases = [
        ModelCase(model=name, args=tuple(prepared[name].args), cp=cp, layout=layout, dtype=dtype, sharding=s,
                  impl=args.impl, seed=args.seed, exact=args.exact, source=source)
        for name in names for cp in cps for layout, source, dtype in covering(layouts, model_sources[name], dtypes)
        for s in shardings
    ]
    console.print(f"verify model: {len(names)} model(s) x {len(cases) // max(1, len(names))} cases, --impl {args.impl}",
                  markup=False)
    t0 = time.perf_counter()
    results = []

    seen: set[str] = set()

    def on_result(r) -> None:
        results.append(r)
        report_result(console, r, seen)

    own = session is None
    session = session or ModelSession(case_timeout=args.case_timeout, backend=args.backend or "gloo")
    try:
        session.run(cases, prepared, on_result=on_result)
        infos = {name: model_info(session.reference(prepared[name], args.seed)) for name in names}
        layers = {name: _refused_layers(session.reference(prepared[name], args.seed))
                  for name in names if any(r.case.model == name and r.cls == "unsupported" for r in results)}
    finally:
        if own:
            session.close()
    wall = time.perf_counter() - t0
    _summary(console, results, names, infos)
    _refusals(console, results, layers)
    coverage = {name: model_coverage([r.case for r in results if r.case.model == name], cps, layouts,
                                     model_sources[name], dtypes) for name in names}
    for name in names:
        console.print(f"{name}: " + ", ".join(f"{k} {v['met']}/{v['total']}" for k, v in coverage[name].items())
                      + " pairs met at every CP size", markup=False, soft_wrap=True)
    counts = Counter(r.cls for r in results)
    console.print(f"verify model: {len(results)} cases in {wall:.1f} s: " + ", ".join(f"{c} {k}" for c, k in counts.items()),
                  markup=False)
    data = {"impl": args.impl, "wall_seconds": round(wall, 1), "cps": cps, "layouts": layouts, "dtypes": dtypes,
            "sources": sources, "coverage": coverage,
            "environment": _environment(), "models": {n: infos[n] for n in names},
            "results": [r.to_dict() for r in results]}
    if args.json:
        text = json.dumps(_plain(data), indent=1, allow_nan=False)
        if args.json == "-":
            print(text)
        else:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.md:
        from .report import write_markdown

        write_markdown(args.md, _plain(data))
    tolerated = ("pass", "unsupported", "unavailable") if args.allow_unsupported else ("pass",)
    return 0 if all(r.cls in tolerated for r in results) else 1


def _environment() -> dict[str, Any]:
    import platform

    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "device": "cpu", "backend": "gloo"}


def _summary(console, results, names, infos) -> None:
    from rich.table import Table

    from .harness import describe_exercised

    table = Table(title="verify model: per model, CP size and dtype (worst over layouts)")
    for col in ("model", "CP", "dtype", "cases", "class", "worst grad err", "exercised", "first wrong / refusal"):
        table.add_column(col)
    groups: dict[tuple, list] = {}
    for r in results:
        groups.setdefault((r.case.model, r.case.cp, r.case.dtype), []).append(r)
    order = {n: i for i, n in enumerate(names)}
    for (model, cp, dtype), rs in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], kv[0][2])):
        counts = Counter(r.cls for r in rs)
        worst = max((r.verdict.get("worst_grad", 0.0) for r in rs if r.verdict), default=None)
        bad = next((r for r in rs if r.cls != "pass"), None)
        what = ""
        if bad is not None:
            what = bad.message or bad.why
        done = sorted({describe_exercised(r.exercised) for r in rs if r.exercised} - {""})
        table.add_row(model, str(cp), dtype, str(len(rs)), ", ".join(f"{c} {n}" for c, n in counts.items()),
                      "-" if worst is None else f"{worst:.2e}", " | ".join(done) or "-", clip(what))
    console.print(table)
    for n in names:
        if infos[n].get("float64_islands"):
            console.print(f"{n}: float64 cases run " + ", ".join(infos[n]["float64_islands"]) + " in float64 on both sides "
                          "(the model computes them in float32 whatever its dtype; the preset's float64_islands)",
                          markup=False, soft_wrap=True, highlight=False)
        ops = infos[n].get("float32_ops") or []
        if ops:
            cost = infos[n].get("float32_cost")
            console.print(f"{n}: computes below float64 in " + "; ".join(ops)
                          + (f" (cost: worst gradient {cost:.1e} against the same model all in float64)" if cost is not None else ""),
                          markup=False, soft_wrap=True, highlight=False)


def report_result(console, r, seen: set[str]) -> None:
    """Print a case that did not pass as it arrives: its class, why, the message and a replay line; a refusal
    (or a cannot-run) whose message is in ``seen`` is not printed again (the summary counts it). A pass only with
    every op in float64 is printed with what differed at the model's own precision."""
    if r.cls == "pass":
        if r.verdict.get("rounding_only"):  # judged again with every op in float64 (run.with_exact_run): say so
            console.print(f"PASS {r.case.label()}: {r.notes[-1]}", markup=False, soft_wrap=True, highlight=False)
        return
    if r.cls in REFUSED and r.message:
        if r.message in seen:
            return
        seen.add(r.message)
    console.print(f"{r.cls.upper()} {r.case.label()}: {r.why}" + (f" -- {r.message}" if r.message else ""),
                  markup=False, soft_wrap=True, highlight=False)
    console.print(f"  reproduce: {r.case.command()}", markup=False, soft_wrap=True)


def _refused_layers(ref) -> list[str]:
    """The layers of the reference model the guard refuses under CP, by class: 'RwkvSelfAttention x2 (rwkv)'."""
    from blockdiag_dist.guard import check_model

    try:
        model, _ = ref.model("float64")
    except Exception:  # noqa: BLE001 - the refusal itself is reported either way
        return []
    counts: dict[tuple[str, str], int] = {}
    for f in check_model(model):
        if f.per_document is None:
            counts[(f.cls, f.kind)] = counts.get((f.cls, f.kind), 0) + 1
    return [f"{cls} x{n} ({kind})" for (cls, kind), n in counts.items()]


def _refusals(console, results, layers: dict[str, list[str]]) -> None:
    """Each distinct refusal once: how many cases gave it, which (CP, dtype, layout) they were, the layers of the
    model the guard refuses, and the pages that say what is planned and how to extend."""
    groups: dict[str, list] = {}
    for r in results:
        if r.cls in REFUSED and r.message:
            groups.setdefault(r.message, []).append(r)
    for message, rs in groups.items():
        models = sorted({r.case.model for r in rs})
        cps = sorted({r.case.cp for r in rs})
        console.print(f"{rs[0].cls} in {len(rs)} case(s) of {', '.join(models)} (CP {', '.join(map(str, cps))}; "
                      f"{', '.join(sorted({r.case.dtype for r in rs}))}; layouts {', '.join(sorted({r.case.layout for r in rs}))}): "
                      f"{clip(message, 160)}", markup=False, soft_wrap=True, highlight=False)
        kinds = sorted({k for m in models for k in layers.get(m, [])})
        if kinds:
            console.print(f"  layers refused under CP: {'; '.join(kinds)}", markup=False, soft_wrap=True, highlight=False)
        pages = guide(message)
        if pages:
            console.print(f"  {pages}", markup=False, soft_wrap=True, highlight=False)
