"""Workloads shared by the benchmarks (``bench``) and the GPU check (``verify.gpu``): long-tail document lengths,
useful attention work, one attention step as a closure (blockdiag, or torch's SDPA per document), and timing that
compares side by side."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from blockdiag_ref import DocLayout

__all__ = [
    "D", "H", "HKV", "attention_step", "interleaved", "layout_of", "long_tail", "make_qkv", "matmul_rate",
    "per_document_sdpa_step", "per_document_slices_step", "useful_pairs",
]

H, HKV, D = 8, 2, 64  # the benchmarks' default heads and head dim


def long_tail(S: int, seed: int = 0, *, alpha: float = 1.2, shortest: int = 32, longest: int = 2048) -> list[int]:
    """Document lengths filling ``S`` tokens: Pareto(``alpha``) above ``shortest``, capped at ``longest``
    (the last document is cut to fit). Many short documents, a few long ones."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while sum(out) < S:
        n = min(longest, int(shortest * (1 + rng.pareto(alpha))))
        out.append(min(n, S - sum(out)))
    return out


def layout_of(lengths: list[int]) -> DocLayout:
    return DocLayout.from_seqlens(lengths)


def useful_pairs(lengths: list[int], window_left: int = -1) -> int:
    """(query, key) pairs of causal attention inside each document."""
    if window_left < 0:
        return sum(n * (n + 1) // 2 for n in lengths)
    w = window_left + 1
    return sum(min(i + 1, w) for n in lengths for i in range(n))


def interleaved(fns: dict[str, Callable[[], None]], reps: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function, measured in alternation (A B A B ...) so that the machine's drift
    hits all of them alike; ratios of these medians are the benchmark's figures."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_rate(n: int = 2048, reps: int = 5) -> float:
    """This machine's float32 matmul rate, GFLOP/s (median of ``reps`` ``n x n @ n x n``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = interleaved({"mm": lambda: a @ b}, reps)["mm"]
    return 2 * n**3 / t / 1e9


def make_qkv(S: int, dtype, device, seed: int, heads: tuple[int, int] = (H, HKV), dim: int = D):
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
    q, k, v, grad_out = make_qkv(S, dtype, device, seed, heads, dim)

    def step() -> None:
        with ctx():
            out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad_out)

    return step


def per_document_sdpa_step(lengths: list[int], dtype=torch.float32, device="cpu", seed: int = 0, *,
                           heads: tuple[int, int] = (H, HKV), dim: int = D) -> Callable[[], None]:
    """torch's own SDPA called once per document on separate exact-size tensors (no padding, no packing, no
    CP machinery): the rate torch's own kernel reaches on these documents."""
    docs = [make_qkv(n, dtype, device, seed + i, heads, dim) for i, n in enumerate(lengths)]

    def step() -> None:
        for q, k, v, grad_out in docs:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad_out)

    return step


def per_document_slices_step(lengths: list[int], dtype=torch.float32, device="cpu", seed: int = 0) -> Callable[[], None]:
    """torch's own SDPA called once per document on slices of one packed row, outputs concatenated: what a
    model does by hand without a varlen kernel (the packed row's gradients assembled by autograd)."""
    q, k, v, grad_out = make_qkv(sum(lengths), dtype, device, seed)
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()

    def step() -> None:
        outs = [torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True)
                for a, b in zip(bounds[:-1], bounds[1:])]
        torch.autograd.grad(torch.cat(outs, 2), (q, k, v), grad_out)

    return step
