"""The one tolerance table of the verifier, and the stock kernels its baseline covers.

float64: the implementation must agree with the float64 reference to ``rel`` relative to the largest
reference magnitude of the compared quantity.

Lower precisions follow the flash-attention rule: the implementation's error against the float64 reference
may be at most ``factor`` times the error of the same computation done single-device in that dtype, plus
``floor`` relative to the largest reference magnitude. That single-device computation (the *baseline*) is
stock SDPA with the dense per-document mask, run once on **every** SDPA backend torch offers for the device
and dtype (``BASELINE_BACKENDS``); the baseline error is the largest of them. An implementation is entitled
to any stock kernel, so it is never held to a more accurate kernel than the one it may be given (on CPU the
fused kernel's float32 gradient error grows with the softmax's peak about 10x faster than the math
backend's; on other CPUs the default may be either). A backend that refuses the mask on the device but may be
given the implementation's maskless pieces (CUDA's flash) is run where it takes the mask (``STAND_INS``). At CP
>= 2 the fused backends also run as a rank calls them, its queries against the row's keys (``"<backend> per
rank"``): a fused kernel's rounding depends on the call's shape (docs/verifier.md).

What the baseline does not cover is what the implementation adds around the kernel: padding, batching,
merging. Those must keep the kernel's accuracy (the varlen kernel runs short pieces at their exact length for
this reason, and a test compares it with stock SDPA per document); a looser limit never absorbs them.

The limits stay sharp: a planted bug that scales K and V by ``1 + 1e-4`` on the wire fails every float32 case
at every CP size, ``1 + 1e-9`` every float64 case (``verify.mutants.kv_scale``, tests/test_verify.py).

Padding rows of outputs, and gradients of padding queries, keys and values, must be exactly 0 in every dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BASELINE_BACKENDS", "STAND_INS", "TOLERANCES", "Tolerance", "judge", "sdpa_backend"]


@dataclass(frozen=True)
class Tolerance:
    rel: float | None = None  # float64: absolute limit = rel * scale
    factor: float | None = None  # low precision: limit = factor * baseline error + floor * scale
    floor: float = 0.0


TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(rel=1e-10),
    "float32": Tolerance(factor=2.0, floor=4e-6),
    "bfloat16": Tolerance(factor=2.0, floor=4e-3),
    "float16": Tolerance(factor=2.0, floor=5e-4),
}

# SDPA backends (torch.nn.attention.SDPBackend names, lower case) the baseline runs on, per device type. A
# backend that refuses the inputs (e.g. CUDA flash with an explicit mask) is skipped and named in the report.
BASELINE_BACKENDS: dict[str, tuple[str, ...]] = {
    "cpu": ("math", "flash_attention"),
    "cuda": ("math", "flash_attention", "efficient_attention", "cudnn_attention"),
}

# A backend that refuses the baseline's explicit mask on a device, where the implementation may still be given it
# for pieces that need no mask, in these dtypes: CUDA's flash backend (fp16/bf16, ``is_causal`` or no mask; the
# varlen kernel's whole-document and fully visible pieces). Its rounding is stood in for by the same algorithm on
# another device whose backend takes the mask: the CPU's flash backend (tiled online softmax, fp32 accumulators,
# probabilities rounded to the input dtype before they multiply the values). Measured on an H200 (2026-12-04): a
# bfloat16 case whose implementation ran pieces on CUDA's flash had dq and dk errors equal, to three digits, to
# the CPU flash baseline's, and 10-30x CUDA's cuDNN and MATH baselines' (docs/gpu.md#results).
STAND_INS: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "cuda": {"flash_attention": ("cpu", ("float16", "bfloat16"))},
}


def sdpa_backend(name: str):
    """``"math"`` -> ``torch.nn.attention.SDPBackend.MATH``; ValueError naming the choices otherwise."""
    from torch.nn.attention import SDPBackend

    choices = [n.lower() for n in SDPBackend.__members__ if n not in ("ERROR", "OVERRIDEABLE")]
    if name not in choices:
        raise ValueError(f"SDPA backend: expected one of {choices}, got {name!r}")
    return SDPBackend.__members__[name.upper()]


def judge(dtype: str, err: float, scale: float, baseline_err: float | None) -> tuple[float, bool]:
    """(limit, ok) for an error ``err`` of a quantity whose largest reference magnitude is ``scale``;
    ``baseline_err`` is the worst single-device baseline error over ``BASELINE_BACKENDS``."""
    tol = TOLERANCES[dtype]
    if tol.rel is not None:
        limit = tol.rel * scale
    else:
        assert baseline_err is not None, f"{dtype} needs the single-device baseline error"
        limit = tol.factor * baseline_err + tol.floor * scale
    return limit, err <= limit
