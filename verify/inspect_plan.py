"""``python -m verify plan``: what a layout costs on each rank, before running anything.

    python -m verify plan --seqlens 300,20,700 --pad 4 --cp 4 [--window 128] [--heads 8:2 --dim 64 --dtype bfloat16]

Per rank: rows held, real tokens, attention work (query-key pairs its real queries attend), tokens needed from
other ranks, and K/V bytes received by each exchange mode next to the minimum; then the mode ``auto`` picks,
with its reason, and max/mean imbalance of work and tokens.
"""

from __future__ import annotations

import json

import torch
from rich.table import Table

from blockdiag_dist.plan import plan_step
from blockdiag_dist.state import choose_exchange
from blockdiag_ref import DocLayout

from .report import make_console
from .cases import parse_rows

__all__ = ["H200", "inspect", "main", "model_step"]

# The machine of the paper model (docs/scale.md): vendor peak figures, each named, and the efficiencies assumed.
H200 = {
    "bf16_dense_flops": 989e12,  # NVIDIA H200 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity, half dense
    "nvlink_bytes_per_s": 450e9,  # NVLink 4: 900 GB/s per GPU, both directions together; one direction
    "ib_bytes_per_s": 50e9,  # one 400 Gb/s NDR InfiniBand adapter (ConnectX-7) per GPU, one direction
    "gpus_per_node": 8,  # HGX H200: 8 GPUs on one NVLink switch fabric
    "attention_efficiency": 0.5,  # assumed: a varlen attention kernel reaches half the dense peak, forward and backward
    "link_efficiency": 0.8,  # assumed: a collective reaches 80% of the link's peak
    "backward_over_forward": 2.5,  # attention backward FLOPs / forward FLOPs (recomputes the scores: 5 matmuls vs 2)
}


def _doc_ids(args) -> torch.Tensor:
    if args.rows:
        rows = parse_rows(args.rows)
        return torch.tensor([[i for i, n in row for _ in range(n)] for row in rows])
    if not args.seqlens:
        raise ValueError("plan: expected --seqlens 300,20,700 (rows separated by /) or --rows 1x300,2x20")
    rows = [[int(x) for x in r.split(",") if x.strip()] for r in args.seqlens.split("/")]
    return DocLayout.from_seqlens(rows, pad=args.pad).doc_ids


def inspect(doc_ids: torch.Tensor, cp: int, *, window: int = -1, layout: str = "contiguous", hkv: int = 2,
            dim: int = 64, dtype: str = "bfloat16") -> dict:
    """The plan's per-rank numbers as plain data (bytes count K and V of ``hkv`` heads of ``dim``)."""
    plan = plan_step(doc_ids, cp, layout)
    x = plan.exchange(window)
    bpt = hkv * 2 * dim * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    mode, reason = choose_exchange(x, "auto")
    needed = x.needed_tokens()
    work, tokens = plan.work_per_rank(window), plan.real_tokens_per_rank()
    ag = x.allgather_tokens()
    ranks = []
    for r in range(cp):
        pos = plan.shards.positions[r]
        ranks.append({
            "rank": r, "rows": [int(pos.min()), int(pos.max())] if plan.shards.layout == "contiguous" else pos.tolist(),
            "tokens": tokens[r], "work": work[r], "needed_tokens": needed[r], "sent_tokens": x.sent_tokens()[r],
            "bytes": {"allgather": ag * bpt if cp > 1 else 0, "halo": needed[r] * bpt if x.halo_ok else None,
                      "a2a": needed[r] * bpt, "minimum": needed[r] * bpt},
        })

    def imbalance(v: list[int]) -> float:
        mean = sum(v) / len(v)
        return max(v) / mean if mean else 1.0

    return {
        "cp": cp, "layout": plan.shards.layout, "window": window, "seq_len": plan.shards.seq_len,
        "padded_len": plan.shards.padded_len, "rows_per_rank": plan.shards.local_len, "bytes_per_token": bpt,
        "auto": {"mode": mode, "reason": reason}, "ranks": ranks,
        "work_max_over_mean": imbalance(work), "tokens_max_over_mean": imbalance(tokens),
        "total_bytes": {m: sum((r["bytes"][m] or 0) for r in ranks) for m in ("allgather", "a2a", "minimum")},
    }


def model_step(doc_ids: torch.Tensor, cp: int, *, window: int = -1, layout: str = "contiguous", hq: int = 8,
               hkv: int = 2, dim: int = 64, dtype: str = "bfloat16", machine: dict | None = None) -> dict:
    """A paper model of one attention layer's step (forward + backward) on ``cp`` GPUs, from the plan exactly:
    per rank, the attention FLOPs of its (query, key) pairs (``4 * dim * hq`` each forward, times
    ``1 + backward_over_forward``), and the K/V bytes it receives by the needed-only exchange (then sends back as
    gradients), split into bytes from ranks of its own node (NVLink) and from other nodes (InfiniBand). Times are
    the machine's named figures (:data:`H200`); the step is bounded below by the slowest rank's larger of compute and
    communication (perfect overlap) and above by their sum (none). The planning time is measured here (CPU)."""
    import time

    m = {**H200, **(machine or {})}
    t0 = time.perf_counter()
    plan = plan_step(doc_ids, cp, layout)
    x = plan.exchange(window)
    mode, _ = choose_exchange(x, "auto")
    planning_s = time.perf_counter() - t0
    bpt = hkv * 2 * dim * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    work = plan.work_per_rank(window)
    g = m["gpus_per_node"]
    flops_per_pair = 4 * dim * hq * (1 + m["backward_over_forward"])
    ranks = []
    for r in range(cp):
        if mode == "allgather":
            local = x.local_tokens
            intra, inter = (min(g, cp) - 1) * local, (cp - min(g, cp)) * local
            fan_in = cp - 1
        else:
            s = x.spans_to(r) if mode != "local" else torch.zeros(0, 6, dtype=torch.int64)
            same = (s[:, 1] // g) == r // g
            intra, inter = int(s[same, 4].sum()), int(s[~same, 4].sum())
            fan_in = int(torch.unique(s[:, 1]).numel())
        compute = work[r] * flops_per_pair / (m["bf16_dense_flops"] * m["attention_efficiency"])
        comm = 2 * max(intra * bpt / (m["nvlink_bytes_per_s"] * m["link_efficiency"]),
                       inter * bpt / (m["ib_bytes_per_s"] * m["link_efficiency"]))  # forward K/V, backward grads
        ranks.append({"rank": r, "work": work[r], "recv_bytes_nvlink": intra * bpt, "recv_bytes_ib": inter * bpt,
                      "fan_in": fan_in, "compute_s": compute, "comm_s": comm})
    mean_work = sum(work) / cp
    return {
        "cp": cp, "layout": plan.shards.layout, "mode": mode, "window": window, "seq_len": plan.shards.seq_len,
        "bytes_per_token": bpt, "machine": m, "planning_s_cpu": planning_s, "ranks": ranks,
        "work_max_over_mean": max(work) / mean_work if mean_work else 1.0,
        "step_s_overlapped": max(max(r["compute_s"], r["comm_s"]) for r in ranks),
        "step_s_serial": max(r["compute_s"] + r["comm_s"] for r in ranks),
        "compute_s_max": max(r["compute_s"] for r in ranks), "comm_s_max": max(r["comm_s"] for r in ranks),
        "recv_bytes_max": max(r["recv_bytes_nvlink"] + r["recv_bytes_ib"] for r in ranks),
        "fan_in_max": max(r["fan_in"] for r in ranks),
    }


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.3f}"


def main(args) -> int:
    console = make_console()
    hq, _, hkv = args.heads.partition(":")
    try:
        doc_ids = _doc_ids(args)
        info = inspect(doc_ids, args.cp, window=args.window, layout=args.layout, hkv=int(hkv or hq), dim=args.dim, dtype=args.dtype)
    except ValueError as exc:
        console.print(f"verify plan: {exc}", markup=False)
        return 2
    if getattr(args, "model", False):
        hq_ = int(hq)
        info["model"] = model_step(doc_ids, args.cp, window=args.window, layout=args.layout, hq=hq_, hkv=int(hkv or hq),
                                   dim=args.dim, dtype=args.dtype, machine={"gpus_per_node": args.gpus_per_node})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    title = (f"plan: S={info['seq_len']} (padded {info['padded_len']}), CP {info['cp']}, layout {info['layout']}, "
             f"window {info['window']}; K/V bytes per token {info['bytes_per_token']}")
    table = Table(title=title)
    for col in ("rank", "rows", "real tokens", "attention work", "needed tokens", "MiB all-gather", "MiB halo", "MiB a2a", "MiB minimum"):
        table.add_column(col, justify="right")
    for r in info["ranks"]:
        rows = f"{r['rows'][0]}..{r['rows'][1]}" if info["layout"] == "contiguous" else f"{len(r['rows'])} positions"
        b = r["bytes"]
        table.add_row(str(r["rank"]), rows, str(r["tokens"]), str(r["work"]), str(r["needed_tokens"]),
                      _mb(b["allgather"]), _mb(b["halo"]), _mb(b["a2a"]), _mb(b["minimum"]))
    console.print(table)
    t = info["total_bytes"]
    console.print(f"auto picks {info['auto']['mode']}: {info['auto']['reason']}", markup=False)
    console.print(f"received in all: all-gather {_mb(t['allgather'])} MiB, needed-only {_mb(t['a2a'])} MiB "
                  f"(minimum {_mb(t['minimum'])} MiB); max/mean attention work {info['work_max_over_mean']:.3f}, "
                  f"max/mean tokens {info['tokens_max_over_mean']:.3f}", markup=False)
    if "model" in info:
        _print_model(info["model"], console)
    return 0


def _print_model(mo: dict, console) -> None:
    m = mo["machine"]
    console.print(
        f"model of one attention layer, forward + backward, on H200s ({m['gpus_per_node']} per NVLink node, "
        f"{m['bf16_dense_flops'] / 1e12:.0f} TFLOP/s bf16 x {m['attention_efficiency']}, NVLink {m['nvlink_bytes_per_s'] / 1e9:.0f} GB/s, "
        f"IB {m['ib_bytes_per_s'] / 1e9:.0f} GB/s, links x {m['link_efficiency']}; docs/scale.md): exchange {mo['mode']}, "
        f"slowest rank compute {mo['compute_s_max'] * 1e3:.3f} ms, communication {mo['comm_s_max'] * 1e3:.3f} ms, "
        f"step {mo['step_s_overlapped'] * 1e3:.3f} (overlapped) .. {mo['step_s_serial'] * 1e3:.3f} ms (serial); "
        f"max/mean work {mo['work_max_over_mean']:.3f}, received at most {_mb(mo['recv_bytes_max'])} MiB per rank "
        f"from at most {mo['fan_in_max']} ranks; planning {mo['planning_s_cpu'] * 1e3:.1f} ms on this CPU", markup=False)
