"""Single-process benchmarks: the local kernel (varlen vs dense mask) and how step time grows with S."""

from __future__ import annotations

import torch

from verify.workloads import (
    D, H, HKV, attention_step, interleaved, long_tail, matmul_rate, per_document_sdpa_step, per_document_slices_step,
    useful_pairs,
)

__all__ = ["bench_kernel", "bench_scaling"]

def bench_kernel(sizes: tuple[int, ...] = (4096, 16384), reps: int = 3, seed: int = 0) -> dict:
    """Varlen vs dense-mask attention, forward + backward, float32, long-tail documents; the useful attention
    FLOP rate next to this machine's matmul rate, and torch's SDPA per document, measured in the same run."""
    torch.manual_seed(seed)
    mm = matmul_rate()
    rows = []
    for S in sizes:
        lengths = long_tail(S, seed)
        t = interleaved({
            "varlen": attention_step(lengths, "varlen"), "dense": attention_step(lengths, "dense"),
            "per_doc": per_document_sdpa_step(lengths), "per_doc_slices": per_document_slices_step(lengths),
        }, reps)
        pairs = useful_pairs(lengths)
        flops = 12 * D * H * pairs  # forward 4 D + backward 8 D per (query, key) pair and head
        rows.append({
            "S": S, "docs": len(lengths), "longest_doc": max(lengths), "mean_doc": S / len(lengths),
            "varlen_s": t["varlen"], "dense_s": t["dense"], "per_doc_sdpa_s": t["per_doc"],
            "speedup_over_dense": t["dense"] / t["varlen"], "dense_pairs_over_useful": S * S / pairs,
            "useful_gflops": flops / t["varlen"] / 1e9, "fraction_of_matmul": flops / t["varlen"] / 1e9 / mm,
            "per_doc_sdpa_fraction_of_matmul": flops / t["per_doc"] / 1e9 / mm,
            "per_doc_slices_s": t["per_doc_slices"],
        })
    return {"matmul_gflops": mm, "heads": [H, HKV], "head_dim": D, "dtype": "float32", "rows": rows}


def bench_scaling(sizes: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768), reps: int = 3, seed: int = 0) -> dict:
    """Varlen step time against S for one document-length distribution: it should grow about linearly."""
    steps = {S: attention_step(long_tail(S, seed), "varlen") for S in sizes}
    t = interleaved({str(S): fn for S, fn in steps.items()}, reps)
    base = sizes[0]
    rows = [{"S": S, "seconds": t[str(S)], "us_per_token": t[str(S)] / S * 1e6,
             "time_ratio": t[str(S)] / t[str(base)], "size_ratio": S / base} for S in sizes]
    return {"rows": rows}
