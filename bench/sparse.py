"""DeepSeek Sparse Attention (``blockdiag_dist.dsa_attention``): a DSA step at CP 2 against the same step on one
device on the same cores, and the bytes of indexer keys and latents each rank receives against an all-gather.

The block: MLA-like queries ``[B, H, L, D]`` and latents ``[B, L, F]`` expanded by two projections, an indexer of
``HI`` heads of ``DI`` keeping ``TOPK`` keys per query, long-tail documents; float32, forward + backward.
"""

from __future__ import annotations

import os
import time

import torch

from blockdiag_dist import DsaIndex, dsa_attention, make_cp_blockdiag_batch_and_ctx
from verify.pool import WorkerPool, worker_info
from verify.workloads import layout_of, long_tail

__all__ = ["bench_dsa", "dsa_steps"]

H, D, DV, F, HI, DI, TOPK = 4, 48, 32, 80, 4, 32, 256


def _inputs(S: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"q": r(1, H, S, D), "lat": r(1, S, F), "wk": r(F, H * D) / F ** 0.5, "wv": r(F, H * DV) / F ** 0.5,
            "iq": r(1, S, HI, DI), "ik": r(1, S, DI), "iw": r(1, S, HI)}


def dsa_steps(S: int, seed: int, reps: int) -> dict:
    """On this rank (a pool worker, or CP 1 without one): seconds of one DSA forward + backward (median of
    ``reps`` after a warm-up) and the exchange's bytes per rank (chosen, needed-only, all-gather)."""
    cp_mesh = worker_info().get("cp_mesh")
    lengths = long_tail(S, seed)
    ids = layout_of(lengths).doc_ids
    x = _inputs(ids.shape[1], seed)
    ctx, local = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, {"input_ids": torch.zeros_like(ids), "_packed_seq_ids": ids,
                                                                 "q": x["q"].transpose(1, 2).contiguous(), "lat": x["lat"],
                                                                 "iq": x["iq"], "ik": x["ik"], "iw": x["iw"]})
    q = local["q"].transpose(1, 2).contiguous().requires_grad_()
    lat = local["lat"].clone().requires_grad_()
    wk, wv = x["wk"].requires_grad_(), x["wv"].requires_grad_()

    def expand(rows):
        return (rows @ wk).view(-1, H, D), (rows @ wv).view(-1, H, DV)

    def step() -> None:
        with ctx():
            index = DsaIndex(query=local["iq"], key=local["ik"], weights=local["iw"], scale=DI ** -0.5)
            out, _ = dsa_attention(q, lat, expand, topk=TOPK, index=index)
            out.sum().backward()

    step()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    report = ctx.state.comm_report(-1, bytes_per_token=(F + DI) * 4)
    return {"seconds": sorted(times)[len(times) // 2], "mode": report["mode"], "recv_bytes": report["recv"],
            "min_recv_bytes": report["min_recv"], "allgather_recv_bytes": report["allgather_recv"],
            "threads": torch.get_num_threads(), "docs": len(lengths), "S": int(ids.shape[1])}


def bench_dsa(S: int = 8192, reps: int = 3, seed: int = 0, timeout: float = 1800) -> dict:
    """CP 2 (two processes, half the cores each) against CP 1 (one process, every core; and one process on one
    core, the work of the two ranks summed: what CP 2 costs over the same work undivided), and the bytes."""
    cores = os.cpu_count() or 1
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        single = dsa_steps(S, seed, reps)
        torch.set_num_threads(1)
        one_core = dsa_steps(S, seed, reps)
    finally:
        torch.set_num_threads(before)
    with WorkerPool(2, threads_per_worker=max(1, cores // 2), collective_timeout=timeout) as pool:
        per_rank = pool.run(dsa_steps, args=(S, seed, reps), timeout=timeout, name=f"dsa cp2 S{S}")
    cp2 = max(r["seconds"] for r in per_rank)
    r0 = per_rank[0]
    return {"S": S, "topk": TOPK, "heads": H, "head_dims": [D, DV], "latent": F, "indexer": [HI, DI], "dtype": "float32",
            "docs": r0["docs"], "cores": cores, "single_seconds": single["seconds"], "cp2_seconds": cp2,
            "one_core_seconds": one_core["seconds"], "cp2_over_one_core": cp2 / one_core["seconds"],
            "cp2_over_single": cp2 / single["seconds"], "mode": r0["mode"], "recv_bytes_per_rank": r0["recv_bytes"],
            "min_recv_bytes_per_rank": r0["min_recv_bytes"], "allgather_recv_bytes_per_rank": r0["allgather_recv_bytes"]}
