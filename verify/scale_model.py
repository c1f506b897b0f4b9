"""A paper model of one attention step on H200s, from the plans (``python -m verify plan ... --model``;
docs/scale.md): per rank, compute from the plan's attention work and communication from its needed sets, split
into bytes from the rank's own NVLink node and from other nodes, with the machine's figures named in
:data:`H200`.

    >>> from blockdiag_ref import DocLayout
    >>> m = model_step(DocLayout.from_seqlens([300, 20, 700]).doc_ids, 4, hq=8, hkv=2, dim=64)
    >>> m["mode"], m["ranks"][2]["recv_bytes_nvlink"] == 2 * 2 * 64 * 2 * m["ranks"][2]["needed_tokens"]
    ('a2a', True)
"""

from __future__ import annotations

import time

import torch

from blockdiag_dist.plan import plan_step
from blockdiag_dist.state import choose_exchange

__all__ = ["H200", "main", "model_step", "print_model"]

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



def model_step(doc_ids: torch.Tensor, cp: int, *, window: int = -1, layout: str = "contiguous", hq: int = 8,
               hkv: int = 2, dim: int = 64, dtype: str = "bfloat16", machine: dict | None = None) -> dict:
    """A paper model of one attention layer's step (forward + backward) on ``cp`` GPUs, from the plan exactly:
    per rank, the attention FLOPs of its (query, key) pairs (``4 * dim * hq`` each forward, times
    ``1 + backward_over_forward``), and the K/V bytes it receives by the needed-only exchange (then sends back as
    gradients), split into bytes from ranks of its own node (NVLink) and from other nodes (InfiniBand). Times are
    the machine's named figures (:data:`H200`); the step is bounded below by the slowest rank's larger of compute and
    communication (perfect overlap) and above by their sum (none). The planning time is measured here (CPU)."""
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
        ranks.append({"rank": r, "work": work[r], "needed_tokens": intra + inter,
                      "recv_bytes_nvlink": intra * bpt, "recv_bytes_ib": inter * bpt,
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


def print_model(mo: dict, console) -> None:
    m = mo["machine"]
    console.print(
        f"model of one attention layer, forward + backward, on H200s ({m['gpus_per_node']} per NVLink node, "
        f"{m['bf16_dense_flops'] / 1e12:.0f} TFLOP/s bf16 x {m['attention_efficiency']}, NVLink {m['nvlink_bytes_per_s'] / 1e9:.0f} GB/s, "
        f"IB {m['ib_bytes_per_s'] / 1e9:.0f} GB/s, links x {m['link_efficiency']}; docs/scale.md): exchange {mo['mode']}, "
        f"slowest rank compute {mo['compute_s_max'] * 1e3:.3f} ms, communication {mo['comm_s_max'] * 1e3:.3f} ms, "
        f"step {mo['step_s_overlapped'] * 1e3:.3f} (overlapped) .. {mo['step_s_serial'] * 1e3:.3f} ms (serial); "
        f"max/mean work {mo['work_max_over_mean']:.3f}, received at most {mo['recv_bytes_max'] / 2**20:.1f} MiB per rank "
        f"from at most {mo['fan_in_max']} ranks; planning {mo['planning_s_cpu'] * 1e3:.1f} ms on this CPU", markup=False)


def main(args) -> int:
    """``verify plan ... --model``: the model for the inspector's layout, printed after its table."""
    from .inspect_plan import _doc_ids
    from .report import make_console

    hq, _, hkv = args.heads.partition(":")
    model = model_step(_doc_ids(args), args.cp, window=args.window, layout=args.layout, hq=int(hq), hkv=int(hkv or hq),
                       dim=args.dim, dtype=args.dtype, machine={"gpus_per_node": args.gpus_per_node})
    print_model(model, make_console())
    return 0
