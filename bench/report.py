"""Tables, plot and BENCHMARKS.md of a benchmark run (each figure next to its goal)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

GOALS = {
    "speedup_over_dense": 10.0,
    "fraction_of_matmul": 0.5,
    "needed_only_speedup_cp4": 2.0,
    "balanced_work_max_over_mean": 1.05,
    "verifier_cases_per_second": 50.0,
}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def tables(res: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every section present in ``res``."""
    out = []
    if "kernel" in res:
        k = res["kernel"]
        rows = [[str(r["S"]), str(r["docs"]), str(r["longest_doc"]), f"{r['varlen_s'] * 1e3:.0f}", f"{r['dense_s'] * 1e3:.0f}",
                 f"{r['speedup_over_dense']:.1f}x (goal >= {GOALS['speedup_over_dense']:.0f}x)", f"{r['dense_pairs_over_useful']:.1f}x",
                 f"{r['useful_gflops']:.0f}", f"{r['fraction_of_matmul']:.2f} (goal >= {GOALS['fraction_of_matmul']})",
                 f"{r['per_doc_sdpa_s'] * 1e3:.0f} ({r['per_doc_sdpa_fraction_of_matmul']:.2f})"] for r in k["rows"]]
        out.append((f"Local kernel, fwd+bwd, float32, H={k['heads'][0]}, Hkv={k['heads'][1]}, D={k['head_dim']}; matmul rate {k['matmul_gflops']:.0f} GFLOP/s",
                    ["S", "docs", "longest", "varlen ms", "dense ms", "varlen vs dense", "dense pairs / useful pairs", "useful GFLOP/s",
                     "of matmul rate", "torch SDPA per document ms (of matmul rate)"], rows))
    if "scaling" in res:
        rows = [[str(r["S"]), f"{r['seconds'] * 1e3:.0f}", f"{r['us_per_token']:.1f}", f"{r['time_ratio']:.2f}", f"{r['size_ratio']:.0f}"] for r in res["scaling"]["rows"]]
        out.append(("Scaling: varlen step time against S (same document-length distribution)", ["S", "ms", "us/token", "time ratio", "S ratio"], rows))
    if "exchange" in res:
        rows = []
        for row in res["exchange"]["rows"]:
            for name, m in row["modes"].items():
                if "skipped" in m:
                    rows.append([str(row["cp"]), str(row["S"]), name, "-", "-", "-", "-", "-", "-", "not applicable"])
                    continue
                rows.append([str(row["cp"]), str(row["S"]), name + (f" ({m['mode']})" if name == "auto" else ""), f"{m['seconds'] * 1e3:.0f}",
                             f"{m['speedup_over_allgather']:.2f}x", f"{m['exchange_seconds'] * 1e3:.1f}", f"{m['exchange_speedup_over_allgather']:.1f}x",
                             _mib(max(m["recv_bytes_per_rank"])), _mib(max(m["min_recv_bytes_per_rank"])), f"{m['bytes_over_minimum']:.2f}"])
        out.append(("K/V exchange: attention step fwd+bwd, and the exchange alone fwd+bwd (slowest rank), gloo",
                    ["CP", "S", "mode", "step ms", "step vs all-gather", "exchange ms", "exchange vs all-gather", "max MiB recv/rank", "max MiB minimum", "bytes / minimum"], rows))
    if "consensus" in res:
        c = res["consensus"]
        out.append((f"Plan consensus check (on by default), CP {c['cp']}, S={c['S']}, slowest rank",
                    ["batch fn ms, check on", "check off", "on / off", "step ms (fwd+bwd)", "added / step"],
                    [[f"{c['seconds']['on'] * 1e3:.1f}", f"{c['seconds']['off'] * 1e3:.1f}", f"{c['batch_fn_ratio']:.2f}x",
                      f"{c['seconds']['step'] * 1e3:.0f}", f"{c['added_over_step']:.3f}"]]))
    if "cp_efficiency" in res:
        rows = [[str(r["cp"]), str(r["S"]), f"{r['single_seconds'] * 1e3:.0f}", f"{r['cp_seconds'] * 1e3:.0f}", f"{r['speedup']:.2f}x"] for r in res["cp_efficiency"]["rows"]]
        out.append((f"CP efficiency: CP step (W processes x 1 thread) against one process with {res['cp_efficiency']['rows'][0]['cores']} threads doing the same work, on the same {res['cp_efficiency']['rows'][0]['cores']} cores",
                    ["CP", "S", "single process ms", "CP ms", "single / CP"], rows))
    if "balance" in res:
        b = res["balance"]
        rows = [[str(r["cp"]), str(r["S"]), str(r["seed"]), f"{r['contiguous']['work_max_over_mean']:.3f}", f"{r['balanced']['work_max_over_mean']:.3f} (goal <= {GOALS['balanced_work_max_over_mean']})",
                 f"{r['contiguous']['tokens_max_over_mean']:.3f}", f"{r['balanced']['tokens_max_over_mean']:.3f}",
                 str(r["contiguous"]["needed_tokens_total"]), str(r["balanced"]["needed_tokens_total"])] for r in b["plans"]]
        out.append(("Load balance (long-tail layouts): max/mean per rank, contiguous vs balanced",
                    ["CP", "S", "seed", "work contiguous", "work balanced", "tokens contiguous", "tokens balanced", "K/V tokens moved contiguous", "balanced"], rows))
        s = b["step"]
        out.append((f"Balanced vs contiguous step time at CP {s['cp']}, S={s['S']} (one core per rank)", ["layout", "ms", "work per rank"],
                    [[name, f"{s['seconds'][name] * 1e3:.0f}", str(s["work_per_rank"][name])] for name in ("contiguous", "balanced")]
                    + [["speedup", f"{s['speedup']:.2f}x", ""]]))
    if "verifier" in res:
        rows = [[cp, str(v["cases"]), str(v["failed"]), f"{v['cases_per_second']:.1f} (goal >= {GOALS['verifier_cases_per_second']:.0f})"] for cp, v in res["verifier"]["cps"].items()]
        out.append(("Verifier throughput (pool start excluded)", ["CP", "cases", "failed", "cases/s"], rows))
    if "memory" in res:
        m = res["memory"]
        rows = [[str(m["S"]), str(m["cp"]), m["mode"], ", ".join(_gib(x) for x in m["peak_rss_bytes_per_rank"]), _gib(sum(m["peak_rss_bytes_per_rank"])),
                 _gib(m["dense_mask_bytes_per_rank"]), _gib(m["dense_scores_bytes_per_rank"]), f"{m['step_seconds']:.1f}"]]
        out.append(("Memory at scale: varlen + needed-only, float32", ["S", "CP", "exchange", "peak RSS per rank", "sum", "dense mask/rank", "dense scores/rank", "step s"], rows))
    return out


def print_tables(res: dict, console) -> None:
    for title, header, rows in tables(res):
        t = Table(title=title)
        for h in header:
            t.add_column(h)
        for r in rows:
            t.add_row(*r)
        console.print(t)


def write_markdown(res: dict, command: str) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Produced by `{command}` ({'quick' if res['quick'] else 'full'} run, {res['wall_seconds']:.0f} s) on "
        f"{res['machine']['cpus']} CPU cores, torch {res['machine']['torch']}, gloo. Every figure is a ratio of two",
        "measurements taken side by side in that run (alternating repeats, medians); absolute times are this shared",
        "machine's and only frame the ratios. Raw numbers: `results/bench.json`.",
        "",
        "![benchmarks](docs/benchmarks.png)",
        "",
    ]
    for title, header, rows in tables(res):
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def _grouped_bars(ax, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str, *, rotation: int = 0) -> None:
    """One group of bars per label, one bar per series."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x - 0.4 + (i + 0.5) * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks(list(range(len(labels))), labels, rotation=rotation)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    if "kernel" in res:
        rows = res["kernel"]["rows"]
        _grouped_bars(axes[0, 0], [f"S={r['S']}\n{r['speedup_over_dense']:.1f}x" for r in rows],
                      {"dense mask": [r["dense_s"] for r in rows], "varlen": [r["varlen_s"] for r in rows]},
                      "fwd+bwd seconds", "local kernel")
        axes[0, 0].set_yscale("log")
    if "scaling" in res:
        ax, rows = axes[0, 1], res["scaling"]["rows"]
        ax.loglog([r["S"] for r in rows], [r["seconds"] for r in rows], "o-", label="varlen")
        ax.loglog([r["S"] for r in rows], [rows[0]["seconds"] * r["size_ratio"] for r in rows], "--", label="linear in S")
        ax.set_xlabel("S")
        ax.set_ylabel("seconds")
        ax.set_title("step time vs S")
        ax.legend()
    if "exchange" in res:
        rows = res["exchange"]["rows"]
        labels = [f"CP{row['cp']} S={row['S']}" for row in rows]
        speedups: dict[str, list[float]] = {}
        for row in rows:
            for name, m in row["modes"].items():
                speedups.setdefault(name, []).append(m.get("speedup_over_allgather", 0.0))
        _grouped_bars(axes[0, 2], labels, speedups, "speedup over all-gather", "K/V exchange step time")
        axes[0, 2].axhline(1.0, color="grey", lw=0.8)
        mib = {
            "all-gather": [max(row["modes"]["allgather"]["recv_bytes_per_rank"]) / 2**20 for row in rows],
            "a2a (needed-only)": [max(row["modes"]["a2a"]["recv_bytes_per_rank"]) / 2**20 for row in rows],
            "minimum": [max(row["modes"]["a2a"]["min_recv_bytes_per_rank"]) / 2**20 for row in rows],
        }
        _grouped_bars(axes[1, 0], labels, mib, "max MiB received per rank", "K/V bytes per step")
    if "balance" in res:
        plans = res["balance"]["plans"]
        _grouped_bars(axes[1, 1], [f"CP{p['cp']} s{p['seed']}" for p in plans],
                      {layout: [p[layout]["work_max_over_mean"] for p in plans] for layout in ("contiguous", "balanced")},
                      "max/mean attention work", "load balance (long-tail)", rotation=45)
        axes[1, 1].axhline(GOALS["balanced_work_max_over_mean"], color="grey", lw=0.8, ls="--")
    if "verifier" in res:
        ax, v = axes[1, 2], res["verifier"]["cps"]
        ax.bar([f"CP {cp}" for cp in v], [x["cases_per_second"] for x in v.values()])
        ax.axhline(GOALS["verifier_cases_per_second"], color="grey", lw=0.8, ls="--")
        ax.set_ylabel("cases / s")
        ax.set_title("verifier throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
