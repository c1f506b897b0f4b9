"""``python -m verify`` — the command line.

    python -m verify [run] [--impl MODULE] [--cp 1,2,3,4,8] [--dtypes float64,float32] [--json PATH] ...
    python -m verify case --rows 1x5,2x2,0x3 --cp 4 [--heads 4:2 --dim 5 --window 2 ...]
    python -m verify fuzz --examples 200 --seed 0      (or --long --budget 600: documents up to 1,100 tokens)
    python -m verify plan --seqlens 300,20,700 --pad 4 --cp 4
    python -m verify conformance [--impls nemo,ring_attention] [--trainers] [--ringmaster-state] [--md CONFORMANCE.md]
    python -m verify gpu --out DIR [--device cpu|cuda] [--quick]
    python -m verify model --model llama|qwen3_next|path/config.json [--tiny] --cp 1,2 [--impl MODULE] [--json PATH]
    python -m verify model --catalogue [--cp 1,2] [--md docs/models.md] [--json PATH]   (every model type, classed)

--impl takes a module path or an adapter's short name (verify/adapters: nemo, ring_attention, torch_cp,
ring_flash_attn).

Exit status: 0 iff every case passed (2 for a usage error).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence

from rich.console import Console

from .cases import (
    GROWTH_LIMIT, Case, add_case_arguments, case_from_args, coverage, coverage_line, default_matrix, error_growth,
    growth_cases, long_cases, mixer_matrix,
)
from .argtext import csv_list
from .launch import under_torchrun
from .pool import cores_here, yield_cores_to_workers
from .report import Reporter, make_console, write_json
from .runner import applicable, impl_info
from .session import CaseResult, Session

__all__ = ["main"]

QUICK = {"cps": (1, 2, 4), "dtypes": ("float64", "float32")}
# The most cases `make verify` (blockdiag_dist, every option it offers) may hold, full and --quick: the 3-minute budget
# at the throughput measured on 2 CPU cores (docs/verifier.md, "The case matrix"); tests/test_verify_coverage.py
# keeps the matrix within it.
CASE_BUDGET = {"full": 2850, "quick": 1750}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--impl", default="blockdiag_dist",
                       help="module under test, or an adapter name: nemo, ring_attention, torch_cp, ring_flash_attn")
        q.add_argument("--case-timeout", type=float, default=60.0, help="deadline of one case, seconds")
        q.add_argument("--backend", default=None, help="gloo (default on CPU) or nccl (under torchrun on GPUs)")
        q.add_argument("--json", metavar="PATH", help="write per-case results, wall time and cases/s ('-' = stdout)")

    run = sub.add_parser("run", help="the case matrix (default command)")
    common(run)
    run.add_argument("--cp", default="1,2,3,4,8", help="CP sizes (comma-separated)")
    run.add_argument("--dtypes", default=None, help="default: float64,float32 (plus bfloat16,float16 on CUDA)")
    run.add_argument("--kernels", default=None, help="default: every kernel the implementation offers")
    run.add_argument("--exchanges", default=None, help="default: every K/V exchange the implementation offers")
    run.add_argument("--layouts", default=None, help="default: every sharding layout the implementation offers")
    run.add_argument("-k", "--filter", default=None, help="only cases whose label contains this text")
    run.add_argument("--quick", action="store_true", help="CP 1, 2, 4 only")
    run.add_argument("--full-table", action="store_true", help="print every case, not only the summary")

    case = sub.add_parser("case", help="replay one case")
    common(case)
    add_case_arguments(case)

    fuzz = sub.add_parser("fuzz", help="hypothesis-drawn cases; a failure is shrunk and printed as a replay command")
    common(fuzz)
    fuzz.add_argument("--examples", type=int, default=200)
    fuzz.add_argument("--seed", type=int, default=0)
    fuzz.add_argument("--max-cp", type=int, default=8)
    fuzz.add_argument("--max-len", type=int, default=None, help="longest sequence drawn (default 40; 1300 with --long)")
    fuzz.add_argument("--long", action="store_true", help="long rows: documents up to 1,100 tokens, small heads")
    fuzz.add_argument("--budget", type=float, default=None, help="stop drawing new cases after this many seconds")

    conf = sub.add_parser("conformance", help="every implementation x layout x doc-id source x CP x dtype, each case classed")
    conf.add_argument("--impls", default=None, help="comma-separated (default: ours and every adapter)")
    conf.add_argument("--cp", default="1,2,4")
    conf.add_argument("--dtypes", default="float64,float32")
    conf.add_argument("--layouts", default=None, help="comma-separated named layouts (default: all)")
    conf.add_argument("--case-timeout", type=float, default=60.0, help="deadline of one case, seconds")
    conf.add_argument("--backend", default=None)
    conf.add_argument("--md", metavar="PATH", help="write the Markdown report here")
    conf.add_argument("--json", metavar="PATH", help="write the JSON report here")
    conf.add_argument("--trainers", action="store_true",
                      help="also the Trainers section: one step at CP 2 through our trainers, accelerate's CP and TRL")
    conf.add_argument("--trainer-rows", default=None, metavar="PATH:MODEL,...",
                      help="the Trainers rows (default: every path x llama, qwen3_5; see verify/trainers.py)")
    conf.add_argument("--trainer-timeout", type=float, default=300.0, help="deadline of one Trainers row, seconds")
    conf.add_argument("--ringmaster-state", action="store_true",
                      help="also axolotl-ringmaster's state passing on packed documents (verify/ringmaster_state.py)")

    plan = sub.add_parser("plan", help="inspect the exchange plan of a layout: needed tokens, bytes per mode, work per rank")
    plan.add_argument("--seqlens", help="document lengths of one row, e.g. 300,20,700 (rows separated by /)")
    plan.add_argument("--pad", type=int, default=0, help="trailing padding tokens per row")
    plan.add_argument("--rows", help="layout as runs instead, e.g. 1x300,2x20,0x4")
    plan.add_argument("--cp", type=int, required=True)
    plan.add_argument("--window", type=int, default=-1)
    plan.add_argument("--layout", default="contiguous")
    plan.add_argument("--heads", default="8:2", help="Hq:Hkv, for byte counts")
    plan.add_argument("--dim", type=int, default=64)
    plan.add_argument("--dtype", default="bfloat16")
    plan.add_argument("--json", metavar="PATH")
    plan.add_argument("--model", action="store_true", help="also print the paper model of one step on H200s (docs/scale.md)")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per NVLink node, for --model")

    from .model.cli import add_arguments as add_model_arguments

    add_model_arguments(sub.add_parser(
        "model", help="a whole model's training step under CP against each document alone (see docs/verify-model.md)"))

    from .gpu import add_arguments as add_gpu_arguments

    add_gpu_arguments(sub.add_parser("gpu", help="the GPU check: CP 1 matrix, multi-rank cases, kernel benchmark on the device"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):  # the subcommands, not only run's options
        _parser().print_help()
        return 0
    if not argv or argv[0].startswith("-"):
        argv = ["run", *argv]
    args = _parser().parse_args(argv)
    if args.command == "plan":
        from .inspect_plan import main as plan_main

        code = plan_main(args)
        if code == 0 and args.model:
            from .scale_model import main as model_main

            code = model_main(args)
        return code
    if args.command == "conformance":
        from .conformance import main as conformance_main

        return conformance_main(args)
    if args.command == "model":
        from .model.cli import main as model_main

        return model_main(args)
    if args.command == "gpu":
        from .gpu import main as gpu_main

        return gpu_main(args)
    if args.command == "fuzz":
        from .fuzz import main as fuzz_main

        return fuzz_main(args)
    console = make_console()
    try:
        info = impl_info(args.impl)
    except (ImportError, ValueError) as exc:
        console.print(f"verify: cannot use --impl {args.impl}: {exc}", markup=False)
        return 2
    if args.command == "case":
        return _run_case(args, console)
    return _run_matrix(args, info, console)


def _offered(info, option: str, values: tuple[str, ...]) -> tuple[str | None, ...]:
    return values if option in info.options else (None,)


def matrix_axes(info, args) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The CP sizes and dtypes a run of the matrix covers."""
    import torch

    cuda = under_torchrun() and torch.cuda.is_available() and (args.backend in (None, "nccl"))
    cps = tuple(int(c) for c in csv_list(args.cp))
    if args.quick:
        cps = tuple(c for c in cps if c in QUICK["cps"])
    dtypes = tuple(csv_list(args.dtypes)) if args.dtypes else (("float32", "bfloat16", "float16") if cuda else QUICK["dtypes"])
    return cps, dtypes


def build_matrix(info, args) -> list[Case]:
    cps, dtypes = matrix_axes(info, args)
    kernels = tuple(csv_list(args.kernels)) if args.kernels else _offered(info, "kernel", ("varlen", "dense"))
    exchanges = tuple(csv_list(args.exchanges)) if args.exchanges else _offered(info, "kv_exchange", ("auto", "allgather", "halo", "a2a"))
    layouts = tuple(csv_list(args.layouts)) if args.layouts else _offered(info, "layout", _layouts_offered(info))
    cases = list(default_matrix(cps=cps, dtypes=dtypes, kernels=kernels, exchanges=exchanges, layouts=layouts,
                                applicable=lambda c: applicable(info, c), support=info.support()))
    long_kernel = "varlen" if "varlen" in kernels else kernels[0]  # the size classes are the varlen kernel's
    cases += [c for c in long_cases(cps=cps, dtypes=dtypes, layouts=layouts, kernel=long_kernel) if applicable(info, c)]
    if "float32" in dtypes and 1 in cps and max(cps) > 1:  # float32 error must not grow with the CP size
        cases += [c for c in growth_cases(cps=sorted({1, *cps})) if applicable(info, c)]
    if info.mixers:  # the sequence mixers of hybrid models: each named layout once per CP size and mixer
        mixer_dtypes = tuple(d for d in dtypes if d in ("float64", "float32")) or ("float32",)
        cases += [c for c in mixer_matrix(cps=cps, dtypes=mixer_dtypes, layouts=layouts, layers=sorted(info.mixers))
                  if applicable(info, c)]
    if args.filter:
        cases = [c for c in cases if args.filter in c.label()]
    return cases


def _layouts_offered(info) -> tuple[str, ...]:
    names = getattr(getattr(info.module, "options", None), "LAYOUTS", None)
    return tuple(names) if names else ("contiguous",)


def _run_matrix(args, info, console: Console) -> int:
    if under_torchrun():
        return _run_torchrun(args, info, console)
    import torch

    torch.set_num_threads(1)  # the parent computes references beside busy workers: no intra-op thread pool
    try:
        info.support()
    except ValueError as exc:  # it declares no doc-id source the attention cases give
        console.print(f"verify: {exc}", markup=False)
        return 2
    cases = build_matrix(info, args)
    if not cases:
        console.print("verify: no case matches the options given")
        return 2
    reporter = Reporter(console, full_table=args.full_table)
    t0 = time.perf_counter()
    backend = args.backend or "gloo"
    try:  # the ranks first: the parent computes the next cases' references in the time they leave idle
        yield_cores_to_workers("cuda" if backend == "nccl" else "cpu")
    except ValueError as exc:
        console.print(f"verify: {exc}", markup=False)
        return 2
    with Session(args.impl, case_timeout=args.case_timeout, backend=backend) as session:
        with reporter.progress(len(cases)) as advance:
            results = session.run(cases, on_result=advance)
        per_cp = session.throughput()
        per_kind = {kind: session.throughput(kind) for kind in ("attention", "mixer")}
        cpu = session.cpu_per_case() if backend != "nccl" else {}  # on GPUs the CPU is not what bounds the rate
    wall = time.perf_counter() - t0
    reporter.summary(results, wall, args.impl, per_cp, per_kind, cpu, cores_here())
    cov = report_coverage(info, args, [r.case for r in results], console)
    growth_ok = report_growth(results, console)
    if args.json:
        write_json(args.json, results, wall, args.impl, {
            "cases_per_second_by_cp": per_cp, **{f"cases_per_second_by_cp_{k}": v for k, v in per_kind.items()},
            "cpu_seconds_per_case_by_cp": cpu,
            "error_by_cp": error_growth(results), "coverage": cov})
    return 0 if all(r.ok for r in results) and growth_ok else 1


def report_coverage(info, args, cases: Sequence[Case], console) -> dict:
    """Print which (named layout, value) pairs the cases met at every CP size and dtype of the run (the line
    ``pairs met at every CP size and dtype: layout x source 33/33, ...``) and up to five pairs never met; return
    the counts for the JSON report."""
    cps, dtypes = matrix_axes(info, args)
    cov = coverage(cases, cps, dtypes, info.support())
    console.print(coverage_line(cov), markup=False, soft_wrap=True)
    missing = [m for v in cov.values() for m in v["missing"]]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        console.print("never met: " + "; ".join(missing[:5]) + more
                      + (" (-k selects cases)" if getattr(args, "filter", None) else ""), markup=False, soft_wrap=True)
    return cov


def report_growth(results, console) -> bool:
    """Print the float32 error per CP size on the fixed layout; False if it grew more than GROWTH_LIMIT."""
    growth = error_growth(results)
    if not growth:
        return True
    base, top = growth[min(growth)], growth[max(growth)]
    ratio = top / base if base > 0 else float("inf")
    ok = ratio <= GROWTH_LIMIT
    per = ", ".join(f"CP {cp}: {e:.2e}" for cp, e in growth.items())
    console.print(f"{'PASS' if ok else 'FAIL'}: float32 error vs CP size on one fixed layout: {per}; "
                  f"CP {max(growth)} / CP {min(growth)} = {ratio:.2f} (limit {GROWTH_LIMIT})", markup=False)
    return ok


def _run_case(args, console: Console) -> int:
    case = case_from_args(args)
    if under_torchrun():
        args.cp = str(case.cp)
        return _run_torchrun(args, impl_info(args.impl), console, cases=[case])
    t0 = time.perf_counter()
    with Session(args.impl, case_timeout=args.case_timeout, backend=args.backend or "gloo") as session:
        result = session.run_one(case)
    print_case(result, console)
    if args.json:
        write_json(args.json, [result], time.perf_counter() - t0, args.impl)
    return 0 if result.ok else 1


def print_case(result: CaseResult, console: Console) -> None:
    from rich.table import Table

    table = Table(title=f"{result.case.label()}: {result.status.upper()}" + (f" (exchange {result.mode})" if result.mode else ""))
    for col in ("quantity", "error", "limit", "ref scale", "baseline err (worst backend)", "inherited", "rank", "ok"):
        table.add_column(col)
    for name, row in result.metrics.items():
        base, inherited = row.get("base"), row.get("inherited")
        table.add_row(name, f"{row['err']:.3e}", f"{row['limit']:.3e}", f"{row.get('scale', 0):.3e}",
                      "-" if base is None else f"{base:.3e} ({row['base_backend']})",
                      "-" if inherited is None else f"{inherited:.3e}", str(row.get("rank", "")), "yes" if row["ok"] else "NO")
    console.print(table)
    if result.backends:
        console.print(f"SDPA backends: {result.backends}", markup=False, soft_wrap=True)
    if result.details and result.status != "pass":
        console.print(result.details, markup=False, highlight=False)
    console.print(f"reproduce: {result.case.command(result.impl)}", markup=False, soft_wrap=True)


# ---- torchrun ------------------------------------------------------------------------------------------
def _run_torchrun(args, info, console: Console, cases: list[Case] | None = None) -> int:
    """Every rank runs the cases whose CP size equals the launched world, on the launched group. A case that
    raises or passes its deadline ends this process with a message naming case and rank (torchrun then
    stops the others): a stuck collective can never hang the job."""
    import torch.distributed as dist

    from .launch import torchrun_env
    from .runner import check_case, expected_results, pack_expected, unpack_expected

    mesh, rank, world, device = torchrun_env(args.backend)
    if cases is None:
        args.cp = str(world)
        cases = build_matrix(info, args)
    cases = [c for c in cases if c.cp == world]
    quiet = Console(file=open(os.devnull, "w")) if rank != 0 else console

    def in_process(case: Case) -> list[dict]:
        done = threading.Event()

        def watchdog() -> None:
            if not done.wait(args.case_timeout):
                sys.stderr.write(f"verify: rank {rank}: case did not finish within {args.case_timeout:.0f} s: {case.command(args.impl)}\n")
                sys.stderr.flush()
                os._exit(1)

        threading.Thread(target=watchdog, daemon=True).start()
        try:
            expected = expected_results(case, device)
            mine = check_case(case, info, mesh, rank, world, device, pack_expected(expected))
        except BaseException:
            sys.stderr.write(f"verify: rank {rank}: case raised: {case.command(args.impl)}\n{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(1)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        done.set()
        return gathered, unpack_expected(pack_expected(expected))

    reporter = Reporter(quiet, full_table=getattr(args, "full_table", False))
    t0 = time.perf_counter()
    session = Session(args.impl, in_process=in_process)
    with reporter.progress(len(cases), label=f"verifying (torchrun, {world} ranks, {device.type})") as advance:
        results = session.run(cases, on_result=advance)
    wall = time.perf_counter() - t0
    if rank == 0:
        if len(results) == 1 and getattr(args, "command", "") == "case":
            print_case(results[0], console)
        else:
            reporter.summary(results, wall, args.impl)
        if args.json:
            write_json(args.json, results, wall, args.impl, {"backend": dist.get_backend(), "world": world})
    dist.barrier()
    return 0 if all(r.ok for r in results) else 1
