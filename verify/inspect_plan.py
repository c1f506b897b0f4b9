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

__all__ = ["inspect", "main"]


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
    return 0
