"""Local attention kernels over a rank's queries and its delivered key buffer.

``varlen`` (default): per-document pieces, batched by size class, no ``[Tq, Tk]`` mask; flash-attn's varlen
function on CUDA when importable. ``dense``: one SDPA call with the full bool mask (small shards, tests).
Both give padding rows exactly 0 and padding keys exactly 0 gradient. ``explicit``: materialized scores, for
the variants the fused kernels lack (soft-capping; sinks off the varlen kernel's fused blocks).
"""

from .dense import DenseMeta, dense_attention, plan_dense
from .explicit import explicit_attention
from .varlen import VarlenMeta, plan_varlen, varlen_attention

__all__ = [
    "DenseMeta", "VarlenMeta", "dense_attention", "explicit_attention", "plan_dense", "plan_varlen", "varlen_attention",
]
