"""Mamba1's selective scan (Mamba, Falcon-Mamba, Jamba, Zamba) per document, across CP ranks.

Per channel ``i`` a state ``h [N]``; per token ``h = exp(dt A) h + dt x B``, ``y = h . C + D x``, as transformers'
``mamba_selective_scan`` computes it (``dt`` already through ``dt_proj``'s bias and the softplus, ``A = -exp(A_log)``
one number per channel and state entry ``[I, N]``, ``B`` and ``C`` per token, shared by the channels of a group:
one group in Mamba, Falcon-Mamba, Jamba; one per head in Zamba). A piece of a document maps its entering state
affinely and elementwise: ``S_out = M * S_in + C`` with ``M = exp(A sum_t dt_t) [I, N]`` (the ``"diagonal"``
transition) and ``C [I, N]`` the state it leaves from zero: the summary
:func:`blockdiag_dist.mixers.recurrence.run_recurrence` exchanges, ``I * N`` numbers per continuing piece, plus
``I * N`` for a piece that itself continues its document.

Computed in float32, or float64 for float64 inputs (transformers computes the decays and the state's updates in
float32 whatever the model's dtype; its torch path keeps the state itself in the model's dtype), with autocast
off; summaries exchanged and folded in the same dtype unless ``state_dtype`` says otherwise (float32 or float64
only). The scan: :func:`blockdiag_dist.kernels.selective_scan.chunk_selective_scan`; how a kernel that takes no
initial state (mamba_ssm's) gets one is in that module's docstring.

Shape legend: B rows, L rows of a rank, T = B * L, I channels, G groups, N state size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.selective_scan import SCAN_CHUNK, chunk_selective_scan
from .recurrence import STATE_DTYPES, run_recurrence
from .ssd import DecayScan

__all__ = ["SelectiveScan", "prepare_selective_scan", "selective_scan"]


class SelectiveScan(DecayScan):
    """Mamba1's selective scan as a :class:`~blockdiag_dist.mixers.ssd.DecayScan`: inputs ``(la, b, C)``
    token-major, ``la = dt A [T, I, N]`` the log decay, ``b = dt x B [T, I, N]``, ``C [T, G, N]``; state and
    transition ``[I, N]``, the transition acting elementwise."""

    transition = "diagonal"
    name = "selective_scan"
    kernel = staticmethod(chunk_selective_scan)
    default_chunk = SCAN_CHUNK
    decay_input = 0

    def shapes(self, inputs):
        la = inputs[0]
        return (la.shape[1], la.shape[2]), (la.shape[1], la.shape[2])


def _check(x, dt, A, B, C, D, state, state_dtype) -> None:
    from ._common import check_shard

    for name, t, nd in (("x", x, 3), ("dt", dt, 3), ("B", B, 4), ("C", C, 4)):
        check_shard("selective_scan", name, t, state, nd)
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D)):
        if t is not None and not (isinstance(t, Tensor) and t.is_floating_point()):
            raise ValueError(
                f"selective_scan: {name} expected a floating tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    I = x.shape[2]
    if dt.shape != x.shape:
        raise ValueError(f"selective_scan: dt expected shaped like x [B, L, I] = {list(x.shape)}, got {tuple(dt.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"selective_scan: expected C shaped like B {tuple(B.shape)}, got {tuple(C.shape)}")
    G, N = B.shape[2], B.shape[3]
    if I % G:
        raise ValueError(f"selective_scan: expected the channels a multiple of the groups, got I={I}, G={G}")
    if tuple(A.shape) != (I, N):
        raise ValueError(f"selective_scan: A expected [I, N] = [{I}, {N}], got {tuple(A.shape)}")
    if D is not None and tuple(D.shape) != (I,):
        raise ValueError(f"selective_scan: D expected [I] = [{I}], got {tuple(D.shape)}")
    if state_dtype is not None and state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"selective_scan: state_dtype expected one of {[str(d) for d in STATE_DTYPES]} (states are exchanged and "
            f"merged in float32 or better), got {state_dtype}"
        )


def prepare_selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, dtype: torch.dtype
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """Token-major, ``dtype`` inputs of :class:`SelectiveScan` from ``[B, L, ...]`` ones (discretised as
    transformers does: ``dt A``, ``dt x B``; B repeated to the channels of its group)."""
    Bsz, L, I = x.shape
    G, N = B.shape[2], B.shape[3]
    T = Bsz * L
    dt = dt.to(dtype).reshape(T, I)
    la = dt[:, :, None] * A.to(dtype)
    Bc = B.to(dtype).reshape(T, G, 1, N).expand(T, G, I // G, N).reshape(T, I, N)
    b = (dt * x.to(dtype).reshape(T, I))[:, :, None] * Bc
    return la, b, C.to(dtype).reshape(T, G, N)


def selective_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    *,
    state_dtype: torch.dtype | None = None,
    chunk: int = SCAN_CHUNK,
    state=None,
) -> Tensor:
    """Mamba1's selective scan per document over this rank's rows: ``x [B, L, I]``, ``dt [B, L, I]`` (the time
    step, after its bias and softplus), ``A [I, N]`` (negative), ``B, C [B, L, G, N]`` (``G`` dividing ``I``),
    ``D [I]`` (the skip, optional) -> ``y [B, L, I]`` in the computed dtype (float32, float64 for float64 inputs);
    padding rows 0. The gate (``y * silu(z)``) is the caller's. A document continuing from other ranks enters with
    the state their pieces left. ``state`` defaults to the active step's.

    Raises ``ValueError`` naming expected vs got (before any collective) for tensors that are not this rank's
    shard, non-floating inputs, channels that the groups do not divide, ``A`` or ``D`` of other sizes, a
    ``state_dtype`` below float32, and (with the consensus check) ranks that call it with different sizes
    (``PlanMismatchError``).
    """
    from ._common import active_state, bind

    state = active_state(state, x, "selective_scan")
    _check(x, dt, A, B, C, D, state, state_dtype)
    compute = torch.float32
    for t in (x, dt, A, B, C) + (() if D is None else (D,)):
        compute = torch.promote_types(compute, t.dtype)
    sdt = compute if state_dtype is None else torch.promote_types(compute, state_dtype)
    state.agree_mixer(f"selective_scan x{tuple(x.shape[2:])} B{tuple(B.shape[2:])} {compute} state {sdt} chunk {chunk}")
    Bsz, L, I = x.shape
    with torch.autocast(x.device.type, enabled=False):
        inputs = prepare_selective_scan(x, dt, A, B, C, compute)
        y = run_recurrence(SelectiveScan(chunk), inputs, state, state_dtype=sdt).view(Bsz, L, I)
        if D is not None:
            real = (state.docs.doc_index >= 0).to(compute)[..., None]
            y = y + D.to(compute) * x.to(compute) * real
    bind(y, (x, dt, A, B, C) + (() if D is None else (D,)), state)
    return y
