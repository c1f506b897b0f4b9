"""Step ``kernels``: the local attention kernels at CP 1, forward + backward, bfloat16.

For each S, long-tail documents (``verify.workloads.long_tail``): blockdiag's varlen kernel, its dense-mask
kernel, and torch's SDPA called once per document on exact-size tensors. Each is timed on its own (median
of a few repeats after a warm-up, synchronised with the device), with its useful FLOP rate (causal pairs
inside documents, 4 D forward + 8 D backward per pair and head) next to the bfloat16 matmul rate measured
in the same run, its peak device memory, and the SDPA backends it ran. A kernel that fails (e.g. out of
memory) is reported with its error and the next one runs.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable

import torch

from .backends import BackendRecorder
from .step import StepContext

__all__ = ["CONFIG", "run", "summarize"]

CONFIG = {  # the sizes on the GPU; tiny ones for the dry run
    "full": {"sizes": (32768, 131072), "heads": (32, 8), "dim": 128, "reps": 3, "matmul_n": 8192, "dense_max_s": 32768},
    "quick": {"sizes": (128, 256), "heads": (2, 1), "dim": 16, "reps": 1, "matmul_n": 128, "dense_max_s": 256},
}
# the dense kernel's [S, S] mask and scores grow with S squared: at S = 131,072 its step (a 16 GiB mask) did not
# finish within the step's deadline on an H200 (2026-12-04), so it runs up to dense_max_s only
DTYPE = torch.bfloat16


def _synced(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    if device.type != "cuda":
        return fn

    def run() -> None:
        fn()
        torch.cuda.synchronize(device)

    return run


def matmul_tflops(n: int, device: torch.device, reps: int = 10) -> float:
    """bfloat16 ``n x n @ n x n`` rate, TFLOP/s (median)."""
    from ..workloads import interleaved

    a, b = (torch.randn(n, n, dtype=DTYPE, device=device) for _ in range(2))
    t = interleaved({"mm": _synced(lambda: a @ b, device)}, reps, warmup=2)["mm"]
    return 2 * n**3 / t / 1e12


def _measure(make: Callable[[], Callable[[], None]], device: torch.device, reps: int) -> dict:
    """Build one kernel's step, time it, and read its peak memory; the error instead if anything fails."""
    from ..workloads import interleaved

    cuda = device.type == "cuda"
    fn = None
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        fn = _synced(make(), device)
        rec = BackendRecorder()
        with rec.role("step"):
            fn()  # the warm-up
        seconds = interleaved({"step": fn}, reps, warmup=0)["step"]
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        return {"seconds": seconds, "peak_bytes": peak, "sdpa_backends": rec.counts().get("step", {})}
    except Exception as exc:  # noqa: BLE001 - reported per kernel; the next kernel runs
        return {"error": f"{type(exc).__name__}: {exc}"[:600], "traceback": traceback.format_exc()[-3000:]}
    finally:
        del fn
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def run(ctx: StepContext) -> str:
    from ..workloads import attention_step, per_document_sdpa_step
    from ..workloads import long_tail, useful_pairs

    from . import emulate

    cfg = CONFIG["quick" if ctx.quick else "full"]
    device = torch.device(ctx.device)
    ctx.data["flash_attn"] = emulate.for_device(ctx.device)
    hq, hkv = cfg["heads"]
    d = ctx.data
    d.update(dtype="bfloat16", heads=[hq, hkv], head_dim=cfg["dim"], reps=cfg["reps"], rows=[],
             matmul_n=cfg["matmul_n"], matmul_tflops=matmul_tflops(cfg["matmul_n"], device),
             peak_memory="torch.cuda.max_memory_allocated per kernel" if device.type == "cuda" else "not measured on CPU")
    ctx.save()
    kernels = {
        "varlen": lambda L: attention_step(L, "varlen", DTYPE, device, heads=(hq, hkv), dim=cfg["dim"]),
        "per_doc_sdpa": lambda L: per_document_sdpa_step(L, DTYPE, device, heads=(hq, hkv), dim=cfg["dim"]),
        "dense": lambda L: attention_step(L, "dense", DTYPE, device, heads=(hq, hkv), dim=cfg["dim"]),  # last: largest
    }
    ok = True
    for S in cfg["sizes"]:
        lengths = long_tail(S, 0)
        flops = 12 * cfg["dim"] * hq * useful_pairs(lengths)
        row = {"S": S, "docs": len(lengths), "longest_doc": max(lengths), "useful_tflop": flops / 1e12, "kernels": {}}
        d["rows"].append(row)
        for name, make in kernels.items():
            if name == "dense" and S > cfg["dense_max_s"]:
                row["kernels"][name] = {"skipped": f"S={S} > {cfg['dense_max_s']}: the [S, S] mask is "
                                                   f"{S * S / 2**30:.0f} GiB"}
                continue
            if ctx.time_left() <= 0:
                row["kernels"][name] = {"error": "skipped: the step's deadline is near"}
                ok = False
                continue
            t0 = time.perf_counter()
            before = emulate.CALLS["flash_attn_varlen_func"]
            m = _measure(lambda: make(lengths), device, cfg["reps"])
            m["wall_s"] = time.perf_counter() - t0
            if "seconds" in m:
                m["useful_tflops"] = flops / m["seconds"] / 1e12
                m["of_matmul"] = m["useful_tflops"] / d["matmul_tflops"]
            else:
                ok = False
            m["flash_calls"] = emulate.CALLS["flash_attn_varlen_func"] - before
            row["kernels"][name] = m
            ctx.save()
        k = row["kernels"]
        if "seconds" in k.get("varlen", {}) and "seconds" in k.get("dense", {}):
            row["varlen_speedup_over_dense"] = k["dense"]["seconds"] / k["varlen"]["seconds"]
    return "pass" if ok else "incomplete"


def summarize(d: dict) -> list[str]:
    lines = [f"bfloat16, H={d['heads'][0]}, Hkv={d['heads'][1]}, D={d['head_dim']}; matmul {d['matmul_tflops']:.3g} TFLOP/s "
             f"(n={d['matmul_n']})"] if "matmul_tflops" in d else []
    for row in d.get("rows", []):
        parts = []
        for name, m in row["kernels"].items():
            if "seconds" in m:
                mem = f", peak {m['peak_bytes'] / 2**30:.1f} GiB" if m.get("peak_bytes") is not None else ""
                flash = " via flash-attn" if m.get("flash_calls") else ""
                parts.append(f"{name}{flash} {m['seconds'] * 1e3:.1f} ms ({m['useful_tflops']:.3g} TFLOP/s = {m['of_matmul']:.2f} of matmul{mem})")
            else:
                parts.append(f"{name} {m.get('skipped') or m['error'][:120]}")
        speed = f"; varlen {row['varlen_speedup_over_dense']:.1f}x dense" if "varlen_speedup_over_dense" in row else ""
        lines.append(f"S={row['S']} ({row['docs']} docs, longest {row['longest_doc']}): " + "; ".join(parts) + speed)
    return lines
