"""``python -m bench`` (``make bench``; ``make bench-quick``: smaller sizes, fewer repeats): every performance figure of the
project, each a ratio of two things measured side by side in this run.

Writes ``results/bench.json`` and ``results/bench.png``; with ``--write-md`` also ``BENCHMARKS.md`` (and the
plot as ``docs/benchmarks.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from blockdiag_dist.plan import plan_step
from verify.pool import WorkerPool
from verify.report import make_console

from .dist import consensus_cost, peak_memory, timed_steps
from .hybrid import bench_hybrid
from .kernel import bench_kernel, bench_scaling
from .plan import LAYOUTS as PLAN_LAYOUTS, bench_plan
from .sparse import bench_dsa
from .peers import bench_peers
from .trainer import bench_trainer
from .vision import vision_steps
from .variants import bench_softcap
from verify.workloads import D, H, HKV, attention_step, interleaved, layout_of, long_tail

ROOT = Path(__file__).resolve().parents[1]
MODES = [{"name": m, "kv_exchange": m} for m in ("allgather", "halo", "a2a", "auto")]


def bench_exchange(cps, sizes, reps, seed=0, timeout=1800) -> dict:
    rows = []
    for cp in cps:
        with WorkerPool(cp, collective_timeout=timeout) as pool:
            for S in sizes:
                per_rank = pool.run(timed_steps, args=(S, seed, MODES, reps), timeout=timeout, name=f"exchange cp{cp} S{S}")
                row = {"cp": cp, "S": S, "modes": {}}
                for m in MODES:
                    name = m["name"]
                    if "skipped" in per_rank[0][name]:
                        row["modes"][name] = {"skipped": per_rank[0][name]["skipped"]}
                        continue
                    row["modes"][name] = {
                        "seconds": max(r[name]["seconds"] for r in per_rank),
                        "exchange_seconds": max(r[name]["exchange_seconds"] for r in per_rank),
                        "mode": per_rank[0][name]["mode"],
                        "recv_bytes_per_rank": [r[name]["recv_bytes_per_step"] for r in per_rank],
                        "min_recv_bytes_per_rank": [r[name]["min_recv_bytes"] for r in per_rank],
                    }
                ag = row["modes"]["allgather"]
                for name, m in row["modes"].items():
                    if "seconds" in m:
                        m["speedup_over_allgather"] = ag["seconds"] / m["seconds"]
                        m["exchange_speedup_over_allgather"] = ag["exchange_seconds"] / m["exchange_seconds"] if m["exchange_seconds"] > 0 else float("inf")
                        mins, got = m["min_recv_bytes_per_rank"], m["recv_bytes_per_rank"]
                        m["bytes_over_minimum"] = sum(got) / sum(mins) if sum(mins) else (1.0 if sum(got) == 0 else float("inf"))
                rows.append(row)
    return {"rows": rows, "docs": "long-tail, <= 2048 tokens", "heads": [H, HKV], "head_dim": D}


def bench_cp_efficiency(cps, S, reps, seed=0) -> dict:
    """CP step (wall, slowest rank) against one process doing the same total work."""
    single = interleaved({"single": attention_step(long_tail(S, seed), "varlen")}, reps)["single"]
    rows = []
    for cp in cps:
        with WorkerPool(cp) as pool:
            per_rank = pool.run(timed_steps, args=(S, seed, [{"name": "auto"}], reps), timeout=1800, name=f"cp{cp}")
        t = max(r["auto"]["seconds"] for r in per_rank)
        rows.append({"cp": cp, "S": S, "cp_seconds": t, "single_seconds": single, "speedup": single / t,
                     "cores": torch.get_num_threads()})
    return {"rows": rows}


def bench_consensus(cp, S, reps, seed=0) -> dict:
    """The plan consensus check (on by default): batch function with / without it, and its cost per step."""
    with WorkerPool(cp) as pool:
        per_rank = pool.run(consensus_cost, args=(S, seed, reps), timeout=1800, name=f"consensus cp{cp}")
    t = {k: max(r[k] for r in per_rank) for k in ("on", "off", "step")}
    collectives = {name: {"cpu_ms": statistics.mean(r["collectives"][name]["cpu_ms"] for r in per_rank),
                          "wall_ms": max(r["collectives"][name]["wall_ms"] for r in per_rank)}
                   for name in per_rank[0]["collectives"]}
    return {"cp": cp, "S": S, "seconds": t, "batch_fn_ratio": t["on"] / t["off"], "added_over_step": (t["on"] - t["off"]) / t["step"],
            "collectives": collectives}


def bench_memory(S, cp, seed=0) -> dict:
    with WorkerPool(cp) as pool:
        per_rank = pool.run(peak_memory, args=(S, seed), timeout=1800, name=f"memory S{S}")
    L = per_rank[0]["local_len"]
    return {
        "S": S, "cp": cp, "heads": [H, HKV], "head_dim": D, "dtype": "float32",
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in per_rank], "mode": per_rank[0]["mode"],
        "dense_mask_bytes_per_rank": L * S,  # bool [L, S] against all-gathered keys
        "dense_scores_bytes_per_rank": H * L * S * 4,  # float32 [H, L, S] if the scores are materialised
        "step_seconds": max(r["seconds"] for r in per_rank),
    }


def bench_verifier(cps, per_cp_cases) -> dict:
    from verify.cases import default_matrix
    from verify.cli import applicable
    from verify.runner import impl_info
    from verify.session import Session

    info = impl_info("blockdiag_dist")
    torch.set_num_threads(1)
    out = {}
    with Session() as session:
        for cp in cps:
            cases = [c for c in default_matrix(cps=(cp,)) if applicable(info, c)][:per_cp_cases]
            results = session.run(cases)
            out[str(cp)] = {"cases": len(results), "failed": sum(not r.ok for r in results), "cases_per_second": session.throughput()[cp],
                            "cpu_seconds_per_case": session.cpu_per_case().get(cp)}
    torch.set_num_threads(os.cpu_count() or 1)
    return {"cps": out}


def bench_balance(cps, S, seeds, step_cp, step_S, reps) -> dict:
    plans = []
    for cp in cps:
        for seed in seeds:
            ids = layout_of(long_tail(S, seed)).doc_ids
            row = {"cp": cp, "S": S, "seed": seed}
            for layout in ("contiguous", "balanced", "auto"):
                plan = plan_step(ids, cp, layout)
                work, tokens = plan.work_per_rank(), plan.real_tokens_per_rank()
                needed = plan.exchange(-1).needed_tokens()
                row[layout] = {
                    "work_max_over_mean": max(work) / (sum(work) / cp),
                    "tokens_max_over_mean": max(tokens) / (sum(tokens) / cp),
                    "needed_tokens_max": max(needed), "needed_tokens_total": sum(needed),
                    "choice": plan.shards.layout,
                }
            plans.append(row)
    names = ("contiguous", "balanced", "auto")
    configs = [{"name": name, "layout": name} for name in names]
    with WorkerPool(step_cp) as pool:
        per_rank = pool.run(timed_steps, args=(step_S, 0, configs, reps), timeout=1800, name="balance")
    step = {name: max(r[name]["seconds"] for r in per_rank) for name in names}
    work = {name: [r[name]["work"] for r in per_rank] for name in names}
    return {"plans": plans, "step": {"cp": step_cp, "S": step_S, "seconds": step, "speedup": step["contiguous"] / step["balanced"],
                                     "work_per_rank": work}}


def bench_vision(size: str, reps: int, timeout=1800) -> dict:
    """CP 2: a vision-language step with the vision tower replicated vs its images sharded (bench.vision)."""
    with WorkerPool(2, collective_timeout=timeout) as pool:
        per_rank = pool.run(vision_steps, args=(size, reps), timeout=timeout, name=f"vision cp2 {size}")
    r = per_rank[0]
    r["cp"] = 2
    r["sharded_over_replicated"] = r["seconds"]["sharded"] / r["seconds"]["replicated"]
    return r


def run(quick: bool, only: list[str] | None = None) -> dict:
    console = make_console()
    t0 = time.perf_counter()
    res: dict = {"quick": quick, "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}}
    sections = [
        ("peers", lambda: bench_peers(4096 if quick else 8192, rounds=1 if quick else 2, reps=1 if quick else 2)),
        ("kernel", lambda: bench_kernel((4096,) if quick else (4096, 16384), reps=2 if quick else 3)),
        ("variants", lambda: bench_softcap(2048 if quick else 4096, windows=(-1, 128), reps=2 if quick else 3)),
        ("scaling", lambda: bench_scaling((2048, 4096, 8192) if quick else (2048, 4096, 8192, 16384, 32768), reps=2 if quick else 3)),
        ("exchange", lambda: bench_exchange((2, 4), (8192,) if quick else (8192, 32768), reps=2 if quick else 3)),
        ("cp_efficiency", lambda: bench_cp_efficiency((2, 4), 8192 if quick else 32768, reps=2 if quick else 3)),
        ("balance", lambda: bench_balance((4, 8), 32768, (0, 1, 2), step_cp=2, step_S=8192 if quick else 32768, reps=2 if quick else 3)),
        ("consensus", lambda: bench_consensus(4, 8192 if quick else 32768, reps=3 if quick else 5)),
        ("verifier", lambda: bench_verifier((2, 4), 60 if quick else 200)),
        ("vision", lambda: bench_vision("quick" if quick else "full", reps=2 if quick else 3)),
    ]
    sections.append(("trainer", lambda: bench_trainer(steps=6 if quick else 10, rounds=1 if quick else 3)))
    if not quick:
        sections.append(("memory", lambda: bench_memory(131072, 4)))
    # quick: the goals' cases (1M / CP 64 and 16M / CP 1,024, and the growth from 1M to 16M at equal documents)
    sections.append(("plan", lambda: bench_plan((1 << 20, 1 << 24) if quick else (1 << 17, 1 << 20, 1 << 22, 1 << 24),
                                                (64, 1024) if quick else (8, 64, 256, 1024), reps=3,
                                                extra=tuple((1 << 20, 64, "mean2k", layout) for layout in PLAN_LAYOUTS))))
    sections.append(("hybrid", lambda: bench_hybrid((4096,) if quick else (8192, 32768), reps=1,
                                                    mem_S=8192 if quick else 32768, rounds=1 if quick else 2,
                                                    mixer_sizes=(4096,) if quick else (8192,), console=console)))
    sections.append(("sparse", lambda: bench_dsa(4096 if quick else 16384, reps=2 if quick else 3)))
    if only:
        unknown = sorted(set(only) - {n for n, _ in sections})
        if unknown:
            raise SystemExit(f"python -m bench --only: expected sections among {[n for n, _ in sections]}, got {unknown}")
        sections = [(n, fn) for n, fn in sections if n in only]
    for name, fn in sections:
        t = time.perf_counter()
        console.print(f"bench: {name} ...", markup=False)
        res[name] = fn()
        res[name]["section_seconds"] = time.perf_counter() - t
    res["wall_seconds"] = time.perf_counter() - t0
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    p.add_argument("--out", default=str(ROOT / "results"), help="folder for bench.json and bench.png")
    p.add_argument("--write-md", action="store_true", help="also write BENCHMARKS.md and docs/benchmarks.png")
    p.add_argument("--only", default=None, help="comma-separated sections to run (e.g. hybrid); writes bench_<names>.json")
    args = p.parse_args(argv)
    from .report import plot, print_tables, write_markdown

    only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only else None
    res = run(args.quick, only)
    if only:  # a partial run: its own file, no plot or BENCHMARKS.md (they describe the whole run)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench_{'_'.join(only)}{'_quick' if args.quick else ''}.json"
        path.write_text(json.dumps(res, indent=1) + "\n")
        print_tables(res, make_console())
        print(f"wrote {path} in {res['wall_seconds']:.0f} s")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out / "bench.png")
    print_tables(res, make_console())
    if args.write_md:
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(out / "bench.png", ROOT / "docs" / "benchmarks.png")
        command = "make bench-quick" if args.quick else "make bench"
        (ROOT / "BENCHMARKS.md").write_text(write_markdown(res, command))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'} in {res['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
