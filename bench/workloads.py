"""Workloads of the benchmarks: long-tail document lengths, and timing that compares side by side."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from blockdiag_ref import DocLayout

__all__ = ["interleaved", "long_tail", "useful_pairs"]


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
