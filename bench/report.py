"""Tables, plot and BENCHMARKS.md of a benchmark run (each figure next to its goal)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

GOALS = {
    "speedup_over_dense": 10.0,
    "fraction_of_matmul": 0.5,
    "needed_only_speedup_cp4": 1.5,  # CP 4, S = 32k: needed-only step vs all-gather step
    "balanced_work_max_over_mean": 1.05,
    "verifier_cases_per_second": 50.0,
    "cp2_one_doc_auto_over_single": 1.10,  # at most: CP 2 step / single-device step, one causal document
    "cp2_long_tail_auto_over_single": 1.00,  # at most: the same on long-tail packed documents
    "ring_over_auto_one_doc": 7.0,  # at least: ring-attention-pytorch step / blockdiag auto step
    "kernel_over_per_doc_sdpa": 1.00,  # at most: varlen step / torch SDPA per document (at least as fast)
    "vision_shard_over_replicated_cp2": 0.60,  # at most: CP 2 VLM step, images sharded / tower replicated
}
GOAL_AT_MOST = {"cp2_one_doc_auto_over_single", "cp2_long_tail_auto_over_single", "kernel_over_per_doc_sdpa",
                "balanced_work_max_over_mean", "vision_shard_over_replicated_cp2"}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _met(name: str, value: float) -> str:
    ok = value <= GOALS[name] if name in GOAL_AT_MOST else value >= GOALS[name]
    return f"{'met' if ok else 'NOT met'} ({'<=' if name in GOAL_AT_MOST else '>='} {GOALS[name]:.2f}x)"


def goal_figures(res: dict) -> list[tuple[str, str, float, float | None]]:
    """(goal key, what, measured ratio, bound) of every goal whose section is present. The bound is the best
    value this machine allows, from the same run, where one follows from the measurements:

    - ring-attention / auto, one document: ring-attention / single device, the ratio if the CP step cost
      exactly what the single-device step costs on the same cores;
    - needed-only / all-gather at CP 4: all-gather step / (all-gather step - all-gather exchange), the
      speedup if the exchange took no time at all (the rest of the step is attention, the same in both).
    """
    out = []
    if "peers" in res:
        rows = {r["workload"]: r for r in res["peers"]["rows"]}
        auto = {w: r["configs"].get("blockdiag auto", {}) for w, r in rows.items()}
        if "median_ratio" in auto.get("one-doc", {}):
            out.append(("cp2_one_doc_auto_over_single", "CP 2 one causal document, auto / single device", auto["one-doc"]["median_ratio"], None))
        if "median_ratio" in auto.get("long-tail", {}):
            out.append(("cp2_long_tail_auto_over_single", "CP 2 long-tail packed, auto / single device", auto["long-tail"]["median_ratio"], None))
        one = rows.get("one-doc", {})
        ring = one.get("configs", {}).get("ring-attention-pytorch", {})
        if "median_seconds" in ring and "median_seconds" in auto.get("one-doc", {}):
            single = sorted(one["single_seconds"])[len(one["single_seconds"]) // 2]
            out.append(("ring_over_auto_one_doc", "ring-attention-pytorch / blockdiag auto, one document",
                        ring["median_seconds"] / auto["one-doc"]["median_seconds"], ring["median_seconds"] / single))
    if "kernel" in res:
        for r in res["kernel"]["rows"]:
            out.append(("kernel_over_per_doc_sdpa", f"local kernel / torch SDPA per document, S={r['S']}", r["varlen_s"] / r["per_doc_sdpa_s"], None))
    if "vision" in res:
        v = res["vision"]
        out.append(("vision_shard_over_replicated_cp2", f"CP 2 vision-language step, images sharded / tower replicated "
                    f"({v['images']} images)", v["sharded_over_replicated"], None))
    if "exchange" in res:
        for row in res["exchange"]["rows"]:
            if row["cp"] == 4 and row["S"] == 32768:
                best = max((m["speedup_over_allgather"], n) for n, m in row["modes"].items() if n in ("halo", "a2a", "auto") and "seconds" in m)
                ag = row["modes"]["allgather"]
                out.append(("needed_only_speedup_cp4", f"CP 4 S=32k needed-only ({best[1]}) vs all-gather", best[0],
                            ag["seconds"] / (ag["seconds"] - ag["exchange_seconds"])))
    return out


def _peer_cell(c: dict) -> str:
    if "skipped" in c:
        return f"- ({c['skipped']})"
    ratios = c.get("ratio", [])
    spread = f", {min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else ""
    chk = c.get("check")
    verdict = "" if chk is None else (" ok" if chk["ok"] else f" WRONG: err {chk['max_rel_err']:.2g} ({max(chk['errors'], key=chk['errors'].get)})")
    return f"{c['median_seconds']:.2f} s ({c['median_ratio']:.2f}x{spread}){verdict}"


def goals_table(res: dict) -> tuple[str, list[str], list[list[str]]] | None:
    """(title, header, rows) of the goals table, or None when no section with a goal ran."""
    figures = goal_figures(res)
    if not figures:
        return None
    return ("Goals: each figure of this run against its goal, and the bound this machine sets where the run "
            "measures one (see bench.report.goal_figures)", ["figure", "measured", "goal", "bound on this machine"],
            [[what, f"{value:.2f}x", _met(key, value), "-" if bound is None else f"{bound:.2f}x"]
             for key, what, value, bound in figures])


def tables(res: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every section present in ``res``."""
    out = []
    goals = goals_table(res)
    if goals:
        out.append(goals)
    if "peers" in res:
        p = res["peers"]
        names = list(p["rows"][0]["configs"])
        rows = []
        for r in p["rows"]:
            single = r["single_seconds"]
            spread = f" ({min(single):.2f}-{max(single):.2f})" if len(single) > 1 else ""
            rows.append([f"{r['workload']} ({r['docs']} docs; auto = {r['auto_layout'][5:]})", f"{sorted(single)[len(single) // 2]:.2f} s{spread}"]
                        + [_peer_cell(r["configs"][n]) for n in names])
        out.append((f"Peers side by side: attention fwd+bwd, S={p['rows'][0]['S']}, H={p['heads'][0]}, Hkv={p['heads'][1]}, D={p['head_dim']}, "
                    f"{p['dtype']}; single device = one process x {p['threads']} threads (torch SDPA per document); CP {p['cp']} = "
                    f"{p['cp']} gloo processes x 1 thread; time (ratio to single device, spread over rounds), each checked against "
                    f"the single-device result (relative error <= {p['check_rtol']:g})",
                    ["work", "single device"] + names, rows))
    if "kernel" in res:
        k = res["kernel"]
        rows = [[str(r["S"]), str(r["docs"]), str(r["longest_doc"]), f"{r['varlen_s'] * 1e3:.0f}", f"{r['dense_s'] * 1e3:.0f}",
                 f"{r['speedup_over_dense']:.1f}x (goal >= {GOALS['speedup_over_dense']:.0f}x)", f"{r['dense_pairs_over_useful']:.1f}x",
                 f"{r['useful_gflops']:.0f}", f"{r['fraction_of_matmul']:.2f} (goal >= {GOALS['fraction_of_matmul']})",
                 f"{r['per_doc_sdpa_s'] * 1e3:.0f} ({r['per_doc_sdpa_fraction_of_matmul']:.2f})",
                 f"{r['per_doc_slices_s'] * 1e3:.0f} ({r['varlen_s'] / r['per_doc_slices_s']:.2f}x)" if "per_doc_slices_s" in r else "-"]
                for r in k["rows"]]
        out.append((f"Local kernel, fwd+bwd, float32, H={k['heads'][0]}, Hkv={k['heads'][1]}, D={k['head_dim']}; matmul rate {k['matmul_gflops']:.0f} GFLOP/s",
                    ["S", "docs", "longest", "varlen ms", "dense ms", "varlen vs dense", "dense pairs / useful pairs", "useful GFLOP/s",
                     "of matmul rate", "torch SDPA per document ms (of matmul rate)",
                     "torch SDPA per document on slices of the packed row ms (varlen / it)"], rows))
    if "variants" in res:
        v = res["variants"]
        names = [n for n in ("sinks", "softcap blocks", "softcap masked", "softcap dense") if n in v["rows"][0]["seconds"]]
        rows = [[str(r["S"]), "none" if r["window"] < 0 else str(r["window"]), f"{r['seconds']['plain'] * 1e3:.0f}"]
                + [f"{r['seconds'][n] * 1e3:.0f} ({r['over_plain'][n]:.2f}x)" for n in names] + [f"{r['masked_over_blocks']:.2f}"]
                for r in v["rows"]]
        out.append((f"Attention variants, fwd+bwd, CP 1, {v['dtype']}, H={v['heads'][0]}, Hkv={v['heads'][1]}, D={v['head_dim']}, "
                    f"softcap {v['softcap']:g}: ms (ratio to the plain call); soft-capped calls on the fused op's inputs run "
                    f"SOFTCAP_PLAN = {v['chosen']!r}",
                    ["S", "window", "plain ms", *names, "masked / blocks"], rows))
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
        if "collectives" in c:  # results written before the check ran an all-reduce have none
            k = c["collectives"]
            out.append((f"The consensus check's collective, CP {c['cp']}, per call: the all-reduce it runs against an all-gather "
                        "of the same fingerprints (CPU: mean over ranks; wall: slowest rank)",
                        ["collective", "CPU ms per rank", "wall ms", "CPU / all-reduce's"],
                        [[name, f"{k[name]['cpu_ms']:.3f}", f"{k[name]['wall_ms']:.3f}",
                          f"{k[name]['cpu_ms'] / k['all_reduce']['cpu_ms']:.2f}x"] for name in ("all_reduce", "all_gather")]))
    if "cp_efficiency" in res:
        rows = [[str(r["cp"]), str(r["S"]), f"{r['single_seconds'] * 1e3:.0f}", f"{r['cp_seconds'] * 1e3:.0f}", f"{r['speedup']:.2f}x"] for r in res["cp_efficiency"]["rows"]]
        out.append((f"CP efficiency: CP step (W processes x 1 thread) against one process with {res['cp_efficiency']['rows'][0]['cores']} threads doing the same work, on the same {res['cp_efficiency']['rows'][0]['cores']} cores",
                    ["CP", "S", "single process ms", "CP ms", "single / CP"], rows))
    if "balance" in res:
        b = res["balance"]
        rows = [[str(r["cp"]), str(r["S"]), str(r["seed"]), f"{r['contiguous']['work_max_over_mean']:.3f}", f"{r['balanced']['work_max_over_mean']:.3f} (goal <= {GOALS['balanced_work_max_over_mean']})",
                 f"{r['auto']['work_max_over_mean']:.3f} ({r['auto']['choice'][5:]})" if "auto" in r else "-",
                 f"{r['contiguous']['tokens_max_over_mean']:.3f}", f"{r['balanced']['tokens_max_over_mean']:.3f}",
                 str(r["contiguous"]["needed_tokens_total"]), str(r["balanced"]["needed_tokens_total"]),
                 str(r["auto"]["needed_tokens_total"]) if "auto" in r else "-"] for r in b["plans"]]
        out.append(("Load balance (long-tail layouts): max/mean per rank, contiguous vs balanced vs auto (its choice)",
                    ["CP", "S", "seed", "work contiguous", "work balanced", "work auto", "tokens contiguous", "tokens balanced",
                     "K/V tokens moved contiguous", "balanced", "auto"], rows))
        s = b["step"]
        out.append((f"Layouts' step time at CP {s['cp']}, S={s['S']} (one core per rank)", ["layout", "ms", "work per rank"],
                    [[name, f"{s['seconds'][name] * 1e3:.0f}", str(s["work_per_rank"][name])] for name in s["seconds"]]
                    + [["balanced speedup over contiguous", f"{s['speedup']:.2f}x", ""]]))
    if "verifier" in res:
        def cpu(cp: str, v: dict) -> str:  # what a case cost the ranks and the parent (older results have no figure)
            t = v.get("cpu_seconds_per_case")
            return "-" if not t else f"{cp} x {t['rank'] * 1e3:.1f} + {t['parent'] * 1e3:.1f}"

        rows = [[cp, str(v["cases"]), str(v["failed"]), f"{v['cases_per_second']:.1f} (goal >= {GOALS['verifier_cases_per_second']:.0f})",
                 cpu(cp, v)] for cp, v in res["verifier"]["cps"].items()]
        out.append(("Verifier throughput (pool start excluded)",
                    ["CP", "cases", "failed", "cases/s", "CPU ms per case: ranks x each + parent"], rows))
    if "vision" in res:
        v = res["vision"]
        same = "same" if v["loss"]["replicated"] == v["loss"]["sharded"] else f"differs by {abs(v['loss']['replicated'] - v['loss']['sharded']):.2g}"
        out.append((f"Vision tower under CP {v['cp']}: a Qwen2.5-VL-shaped step (4-block tower, hidden 256; one-layer decoder), "
                    f"{v['images']} images, {v['patches']} patches, float32, own forward and backward (slowest rank)",
                    ["tower", "step s", "over replicated", "summed loss"],
                    [["replicated (every rank runs every image)", f"{v['seconds']['replicated']:.2f}", "1.00x", f"{v['loss']['replicated']:.4f}"],
                     ["images sharded by cost (shard_vision=True)", f"{v['seconds']['sharded']:.2f}",
                      f"{v['sharded_over_replicated']:.2f}x (goal <= {GOALS['vision_shard_over_replicated_cp2']:.2f}x)", f"{v['loss']['sharded']:.4f} ({same})"]]))
    if "plan" in res:
        out += plan_tables(res["plan"])
    if "memory" in res:
        m = res["memory"]
        rows = [[str(m["S"]), str(m["cp"]), m["mode"], ", ".join(_gib(x) for x in m["peak_rss_bytes_per_rank"]), _gib(sum(m["peak_rss_bytes_per_rank"])),
                 _gib(m["dense_mask_bytes_per_rank"]), _gib(m["dense_scores_bytes_per_rank"]), f"{m['step_seconds']:.1f}"]]
        out.append(("Memory at scale: varlen + needed-only, float32", ["S", "CP", "exchange", "peak RSS per rank", "sum", "dense mask/rank", "dense scores/rank", "step s"], rows))
    if "trainer" in res:
        t = res["trainer"]
        met = "met" if t["ratio"] <= t["goal"] else "NOT met"
        out.append((f"Trainer step against the hand loop: BlockdiagTrainer vs docs/trainer.md's loop, tiny {t['model']}, "
                    f"CP {t['cp']}, {t['rows']} documents per step, float32, median of {t['rounds']} x {t['steps'] - 2} steps "
                    f"(the runs alternating in one pool, {t.get('threads', '?')} intra-op thread(s) per rank on both sides)",
                    ["Trainer step", "hand loop step", "ratio"],
                    [[f"{t['trainer_seconds'] * 1e3:.1f} ms", f"{t['loop_seconds'] * 1e3:.1f} ms",
                      f"{t['ratio']:.3f} (goal <= {t['goal']:.2f}: {met})"]]))
    if "hybrid" in res:
        out += hybrid_tables(res["hybrid"])
    if "sparse" in res:
        d = res["sparse"]
        ag = max(d["allgather_recv_bytes_per_rank"])
        out.append((f"DeepSeek Sparse Attention (dsa_attention): fwd+bwd, float32, S={d['S']} ({d['docs']} long-tail documents), "
                    f"top-{d['topk']}, H={d['heads']}, D={d['head_dims'][0]}/{d['head_dims'][1]}, latent {d['latent']}, "
                    f"indexer {d['indexer'][0]}x{d['indexer'][1]}; CP 2 (2 processes, half the cores each) against one process "
                    f"on the same {d['cores']} cores; bytes of latents and indexer keys received per rank",
                    ["single ms", "CP 2 ms", "CP 2 / single", "single on 1 core ms", "CP 2 / it", "exchange", "recv bytes per rank", "needed-only", "all-gather",
                     "max recv / all-gather"],
                    [[f"{d['single_seconds'] * 1e3:.0f}", f"{d['cp2_seconds'] * 1e3:.0f}", f"{d['cp2_over_single']:.2f}x",
                      f"{d['one_core_seconds'] * 1e3:.0f}", f"{d['cp2_over_one_core']:.2f}x", d["mode"],
                      str(d["recv_bytes_per_rank"]), str(d["min_recv_bytes_per_rank"]), str(d["allgather_recv_bytes_per_rank"]),
                      f"{max(d['recv_bytes_per_rank']) / ag:.3f}" if ag else "-"]]))
    return out


def plan_tables(p: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """The per-step planning of one rank (bench/plan.py): milliseconds per case and the growth ratios."""
    rows = [[f"{r['S'] / 2**20:g}M", str(r["cp"]), f"{r['mix']} ({r['docs']})", r["layout"], f"{r['replicated_ms']:.1f}",
             f"{r['scan_ms']:.1f}", f"{r['rank_ms']:.1f}", f"{r['total_ms']:.1f}",
             f"{r['first_use_ms']:.1f}" if "first_use_ms" in r else "-",
             f"{r['read_ms']:.1f}" if "read_ms" in r else "-", f"{r['step_ms']:.1f}" if "step_ms" in r else "-",
             f"{r['bounds_ms']:.1f}" if "bounds_ms" in r else "-"]
            for r in p["rows"]]
    growth = [[str(g["cp"]), g["mix"], g["layout"], f"{g['S_from'] / 2**20:g}M -> {g['S_to'] / 2**20:g}M",
               f"{g['replicated']:.2f}x", f"{g['total']:.2f}x",
               f"{g['bounds']:.2f}x" if "bounds" in g else "-"] for g in p["growth"]]
    return [(f"Per-step planning of one rank, ms (torch threads {p['threads']})",
             ["S", "CP", "documents", "layout", "replicated", "of which the doc-id scan", "rank's own", "total",
              "token-level, built on first use (not in total)", "documents read from positions",
              "whole batch function (not in total)", "total from the collator's boundaries"], rows),
            ("Planning growth with S at equal document count",
             ["CP", "documents", "layout", "S", "replicated", "total", "total from the collator's boundaries"], growth),
            ("Planning goals (worst case per layout)", ["goal", "layout", "worst case", "figure", "met"],
             [[g["goal"], g["layout"], g["case"], "-" if g["figure"] is None else
               (f"{g['figure']:.1f} ms" if "ms" in g["goal"] else f"{g['figure']:.2f}x"),
               {True: "met", False: "not met", None: "not measured"}[g["met"]]] for g in p.get("goals", [])])]


def hybrid_tables(h: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """The Gated DeltaNet layer's figures (bench/hybrid.py): bytes per rank, CP 2 against single device and the
    two baselines, peak memory at CP 4."""
    lay = h["layer"]
    goal = h["goals"]["cp2_over_single"]
    rows = []
    for r in h["rows"]:
        over = r["over_single"]
        rows.append([str(r["S"]), str(r["docs"]), f"{r['single_seconds']:.2f} (1 thread: {r['single_1thread_seconds']:.2f}; "
                     f"CP 2 / its half {r['over_half_single_1thread']:.2f}x)",
                     f"{r['seconds']['blockdiag']:.2f} ({over['blockdiag']:.2f}x, goal <= {goal:.2f}x: "
                     f"{'met' if over['blockdiag'] <= goal else 'NOT met'})",
                     f"{r['seconds']['allgather']:.2f} ({over['allgather']:.2f}x)", f"{r['seconds']['a2a_heads']:.2f} ({over['a2a_heads']:.2f}x)",
                     " / ".join(str(b) for b in r["recv_bytes_per_rank"]["blockdiag"]),
                     " / ".join(str(b) for b in (s + hh for s, hh in zip(r["summary_bytes_per_rank"], r["history_bytes_per_rank"]))),
                     " / ".join(_mib(b) for b in r["recv_bytes_per_rank"]["allgather"]),
                     " / ".join(_mib(b) for b in r["recv_bytes_per_rank"]["a2a_heads"])])
    m = h["memory"]
    mem_goal = h["goals"]["memory_over_quarter_single"]
    mixers = []
    for r in h["rows"]:
        for key, name in (("kda", "KDA"), ("mamba1", "Mamba1")):
            x = r.get(key)
            if not x or "step" not in x:
                continue
            st = x["step"]
            plan = " / ".join(str(p["summaries"] + p["history"]) for p in x["plan_bytes_per_rank"])
            mixers.append([name, str(r["S"]), f"{st['single_seconds']:.2f} (1 thread: {st['single_1thread_seconds']:.2f})",
                           f"{st['cp2_seconds']:.2f} ({st['over_single']:.2f}x; CP 2 / half of 1 thread "
                           f"{st['over_half_single_1thread']:.2f}x)",
                           " / ".join(str(b) for b in x["recv_bytes_per_rank"]), plan, _mib(x["allgather_bytes_per_rank"])])
    extra = []
    if mixers:
        kda, scan = h["rows"][0]["kda"]["layer"], h["rows"][0]["mamba1"]["layer"]
        extra.append((f"KDA layer (conv width {lay['width']} + KDA, H={kda['H']}, K=V={kda['K']}) and Mamba1 layer (conv "
                       f"width {lay['width']} + selective scan, I={scan['I']}, N={scan['N']}), float32, {h['docs']}: CP 2 "
                       "(2 processes x 1 thread, contiguous) against one process with 2 threads, forward + backward; "
                       "bytes each rank receives per forward",
                       ["layer", "S", "single s", "blockdiag CP 2 s", "bytes recv/rank", "plan: summaries + history",
                        "all-gather MiB recv/rank"], mixers))
    return [
        (f"Gated DeltaNet layer (conv width {lay['width']} + gated delta rule, Hk={lay['Hk']}, Hv={lay['Hv']}, K=V={lay['K']}, "
         f"float32, {h['docs']}), CP 2 (2 processes x 1 thread) against one process with 2 threads, forward + backward",
         ["S", "docs", "single s", "blockdiag CP 2 s", "all-gather s", "head a2a s", "blockdiag bytes recv/rank",
          "plan: summaries + history", "all-gather MiB recv/rank", "head a2a MiB recv/rank"], rows),
        (f"Gated DeltaNet layer: peak memory per rank at CP {m['cp']}, S={m['S']} (peak RSS increase of one step, fresh processes)",
         ["per rank", "single device", "max / (single / CP)"],
         [[", ".join(_mib(b) + " MiB" for b in m["peak_increase_bytes_per_rank"]), _mib(m["single_peak_increase_bytes"]) + " MiB",
           f"{m['max_over_quarter_single']:.2f} (goal <= {mem_goal:.2f}: {'met' if m['max_over_quarter_single'] <= mem_goal else 'NOT met'})"]]),
    ] + extra


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
        "machine's and only frame the ratios. Raw numbers: `results/bench.json`. On a GPU: `python -m verify gpu`, its",
        "kernel figures on an H200 in [docs/gpu.md](docs/gpu.md#results).",
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

    fig, axes = plt.subplots(3, 3, figsize=(16, 13))
    if "peers" in res:
        for ax, r in zip(axes[2, :2], res["peers"]["rows"]):
            timed = {n: c for n, c in r["configs"].items() if "median_seconds" in c}
            labels = ["single device"] + list(timed)
            values = [sorted(r["single_seconds"])[len(r["single_seconds"]) // 2]] + [c["median_seconds"] for c in timed.values()]
            bars = ax.bar(range(len(labels)), values, color=["grey"] + ["C0"] * 3 + ["C1"] * (len(labels) - 4))
            for b, c in zip(bars[1:], timed.values()):
                if c.get("check") and not c["check"]["ok"]:
                    b.set_hatch("//")
            ax.set_xticks(range(len(labels)), [lb.replace("blockdiag ", "bd ").replace(" blockdiag_cp", "") for lb in labels], rotation=30)
            ax.set_ylabel("fwd+bwd seconds")
            goal = GOALS["cp2_one_doc_auto_over_single" if r["workload"] == "one-doc" else "cp2_long_tail_auto_over_single"]
            ax.axhline(values[0] * goal, color="grey", lw=0.8, ls="--")
            ax.set_title(f"CP {res['peers']['cp']}, {r['workload']}, S={r['S']} (dashed: goal for auto; hatched: wrong result)")
    figures = goal_figures(res)
    if figures:
        ax = axes[2, 2]
        ax.barh(range(len(figures)), [v / GOALS[k] for k, _, v, _ in figures],
                color=["C2" if ((v <= GOALS[k]) if k in GOAL_AT_MOST else (v >= GOALS[k])) else "C3" for k, _, v, _ in figures])
        ax.set_yticks(range(len(figures)), [w[:40] for _, w, _, _ in figures], fontsize=7)
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_title("measured / goal (green: met)")
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
