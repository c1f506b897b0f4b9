"""The one tolerance table of the verifier.

float64: the implementation must agree with the float64 reference to ``rel`` relative to the largest
reference magnitude of the compared quantity.

Lower precisions follow the flash-attention rule: the implementation's error against the float64 reference
may be at most ``factor`` times the error of the same computation done single-device in that dtype (stock
SDPA with the dense per-document mask), plus ``floor`` relative to the largest reference magnitude.

Padding rows of outputs, and gradients of padding queries, keys and values, must be exactly 0 in every dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TOLERANCES", "Tolerance", "judge"]


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


def judge(dtype: str, err: float, scale: float, baseline_err: float | None) -> tuple[float, bool]:
    """(limit, ok) for an error ``err`` of a quantity whose largest reference magnitude is ``scale``."""
    tol = TOLERANCES[dtype]
    if tol.rel is not None:
        limit = tol.rel * scale
    else:
        assert baseline_err is not None, f"{dtype} needs the single-device baseline error"
        limit = tol.factor * baseline_err + tol.floor * scale
    return limit, err <= limit
