"""Single-process benchmarks: the local kernel (varlen vs dense mask) and how step time grows with S."""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

from .workloads import interleaved, layout_of, long_tail, matmul_rate, useful_pairs

__all__ = ["bench_kernel", "bench_scaling"]

H, HKV, D = 8, 2, 64


def _qkv(S: int, dtype, device, seed: int, heads: tuple[int, int] = (H, HKV), dim: int = D):
    """q, k, v laid out as a model makes them: projections ``[B, S, H, D]`` seen as ``[B, H, S, D]``."""
    g = torch.Generator(device=device).manual_seed(seed)
    hq, hkv = heads
    q, k, v = (torch.randn(1, S, h, dim, generator=g, dtype=dtype, device=device).transpose(1, 2).requires_grad_() for h in (hq, hkv, hkv))
    return q, k, v, torch.randn(1, hq, S, dim, generator=g, dtype=dtype, device=device)


def attention_step(lengths: list[int], kernel: str, dtype=torch.float32, device="cpu", seed: int = 0, *,
                   heads: tuple[int, int] = (H, HKV), dim: int = D) -> Callable[[], None]:
    """One forward + backward of per-document attention over a packed row (CP 1), as a closure; ``heads`` is
    ``(Hq, Hkv)``, ``dim`` the head dim."""
    layout = layout_of(lengths)
    S = layout.seq_len
    batch = {"inputs_embeds": torch.zeros(1, S, 1, dtype=dtype, device=device), "_packed_seq_ids": layout.doc_ids.to(device)}
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch, kernel=kernel)
    q, k, v, grad_out = _qkv(S, dtype, device, seed, heads, dim)

    def step() -> None:
        with ctx():
            out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad_out)

    return step


def per_document_sdpa_step(lengths: list[int], dtype=torch.float32, device="cpu", seed: int = 0, *,
                           heads: tuple[int, int] = (H, HKV), dim: int = D) -> Callable[[], None]:
    """torch's own SDPA called once per document on separate exact-size tensors (no padding, no packing, no
    CP machinery): the rate torch's own kernel reaches on these documents."""
    docs = [_qkv(n, dtype, device, seed + i, heads, dim) for i, n in enumerate(lengths)]

    def step() -> None:
        for q, k, v, grad_out in docs:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad_out)

    return step


def per_document_slices_step(lengths: list[int], dtype=torch.float32, device="cpu", seed: int = 0) -> Callable[[], None]:
    """torch's own SDPA called once per document on slices of one packed row, outputs concatenated: what a
    model does by hand without a varlen kernel (the packed row's gradients assembled by autograd)."""
    q, k, v, grad_out = _qkv(sum(lengths), dtype, device, seed)
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()

    def step() -> None:
        outs = [torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True)
                for a, b in zip(bounds[:-1], bounds[1:])]
        torch.autograd.grad(torch.cat(outs, 2), (q, k, v), grad_out)

    return step


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
