"""Strict CPU emulations of the CUDA-only functions blockdiag calls, so that everything around them runs in the
tests and in ``python -m verify gpu --device cpu``:

- :func:`flash_attn_varlen_func`: flash-attn 2.8.3's ``flash_attn.flash_attn_varlen_func``;
- :func:`chunk_gated_delta_rule`: flash-linear-attention (fla-core 0.6.0)'s
  ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``.

*Strict*: each refuses what the real function refuses, with the real function's message (flash-attn's
``TORCH_CHECK`` raises ``RuntimeError``; fla raises ``ValueError``), and also what the real function does not
check but silently computes wrong (``cu_seqlens`` that do not tile the tokens, a sequence longer than
``max_seqlen_q``), and ``NotImplementedError`` for the options blockdiag never uses (dropout's random mask,
ALiBi, paged KV, fla's in-kernel gates). What they compute is the documented math in float64, returned in the
real function's dtypes (flash-attn: the query's; fla: the output in the query's dtype, the final state in
float32), differentiable by autograd. The kernels themselves are the one thing not emulated.

Only the device differs: the real functions take CUDA tensors, these take the tensors of one device, CPU
included. :func:`install` (or the context manager :func:`emulated`) puts them where blockdiag looks for the
real ones and lets its gates accept CPU tensors (``blockdiag_dist.kernels.varlen.FLASH_DEVICE_TYPES``,
``blockdiag_dist.kernels.gated_delta.FLA_DEVICE_TYPES``); :data:`CALLS` counts the calls, so a test can tell
the emulated path ran rather than a fallback::

    with emulated():
        ...                                   # blockdiag's CUDA branches, on CPU tensors
    CALLS["flash_attn_varlen_func"]           # > 0 when the flash path ran
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["CALLS", "calls", "chunk_gated_delta_rule", "count_real_calls", "emulated", "flash_attn_varlen_func", "for_device",
           "install", "uninstall"]

CALLS: Counter = Counter()  # calls per emulated function (and "flash_sequences": sequences passed to flash)
HALF = (torch.float16, torch.bfloat16)


def _check(ok: bool, message: str, exc: type[Exception] = RuntimeError) -> None:
    if not ok:
        raise exc(message)


def _check_cu(cu: Tensor, name: str, total: int, device: torch.device, max_len: int | None,
              exc: type[Exception] = RuntimeError) -> list[int]:
    """Bounds a kernel reads without checking: starting at 0, non-decreasing, ending at the token count, no
    sequence longer than the ``max_seqlen`` the grid is sized by."""
    _check(cu.device == device, f"{name} must be on the device of the inputs ({device}), got {cu.device}", exc)
    _check(cu.dim() == 1, f"{name} must be 1-D, got shape {tuple(cu.shape)}", exc)
    _check(cu.is_contiguous(), f"{name} must be contiguous", exc)
    bounds = [int(x) for x in cu.tolist()]
    _check(bounds[0] == 0 and bounds[-1] == total, f"{name} must run from 0 to {total} tokens, got {bounds[0]} .. {bounds[-1]}", exc)
    lens = [b - a for a, b in zip(bounds, bounds[1:])]
    _check(all(n >= 0 for n in lens), f"{name} must be non-decreasing, got lengths {lens}", exc)
    if max_len is not None:
        _check(max(lens, default=0) <= max_len, f"{name}: a sequence of {max(lens)} tokens > max_seqlen {max_len}: "
               "its tail would not be computed", exc)
    return bounds


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                           max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Tensor | None = None,
                           deterministic: bool = False, return_attn_probs: bool = False, block_table: Tensor | None = None) -> Tensor:
    """``q [total_q, H, D]``, ``k, v [total_k, Hk, D]``, sequence ``i`` = ``q[cu_q[i]:cu_q[i+1]]`` against
    ``k[cu_k[i]:cu_k[i+1]]`` -> ``out [total_q, H, D]`` (query's dtype).

    Causal masks align bottom-right (query ``a`` of ``n`` sees key ``c`` of ``m`` iff ``c <= a + m - n``), a
    window ``(left, right)`` keeps keys in ``[a + m - n - left, a + m - n + right]`` (-1: unbounded), GQA maps
    query head ``h`` to key head ``h // (H / Hk)``, ``softcap > 0`` caps scores as ``softcap * tanh(s /
    softcap)``, and a row with no key outputs 0."""
    CALLS["flash_attn_varlen_func"] += 1
    _check(alibi_slopes is None and block_table is None and not return_attn_probs,
           "emulation: alibi_slopes, block_table and return_attn_probs are not emulated", NotImplementedError)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(isinstance(t, Tensor) and t.dim() == 3, f"{name} must be [total, heads, head_dim], got "
               f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    _check(q.dtype in HALF, "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    _check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _check(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    device = q.device
    _check(k.device == device and v.device == device, "Input tensors must be on the same device")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _check(isinstance(m, int) and not isinstance(m, bool), f"{name} must be a python int, got {type(m).__name__}", TypeError)
    _check(isinstance(window_size, (tuple, list)) and len(window_size) == 2, f"window_size must be (left, right), got {window_size!r}")
    batch = cu_seqlens_q.numel() - 1
    H, D = q.shape[1], q.shape[2]
    Hk = k.shape[1]
    if softcap > 0:
        _check(dropout_p == 0, "Softcapping does not support dropout for now")
    _check(batch > 0, "batch size must be positive")
    padded = -(-D // 8) * 8  # the python wrapper pads the head dim to a multiple of 8 before the C++ checks
    _check(padded <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(H % Hk == 0, "Number of heads in key/value must divide number of heads in query")
    _check(tuple(k.shape[1:]) == (Hk, D), f"k must have shape (total_k, {Hk}, {D}), got {tuple(k.shape)}")
    _check(tuple(v.shape) == tuple(k.shape), f"v must have shape {tuple(k.shape)} (flash-attn 2 needs Dv == D), got {tuple(v.shape)}")
    _check(cu_seqlens_k.numel() == batch + 1, f"cu_seqlens_k must have shape ({batch + 1},), got {tuple(cu_seqlens_k.shape)}")
    _check(dropout_p == 0, "emulation: dropout's random mask is not emulated", NotImplementedError)
    bq = _check_cu(cu_seqlens_q, "cu_seqlens_q", q.shape[0], device, max_seqlen_q)
    bk = _check_cu(cu_seqlens_k, "cu_seqlens_k", k.shape[0], device, max_seqlen_k)
    CALLS["flash_sequences"] += batch
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    left, right = int(window_size[0]), 0 if causal else int(window_size[1])
    group = H // Hk
    outs = []
    for i in range(batch):
        n, m = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        qi = q[bq[i]:bq[i + 1]].double().transpose(0, 1)  # [H, n, D]
        ki = k[bk[i]:bk[i + 1]].double().repeat_interleave(group, 1).transpose(0, 1)
        vi = v[bk[i]:bk[i + 1]].double().repeat_interleave(group, 1).transpose(0, 1)
        s = qi @ ki.transpose(-1, -2) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        diag = torch.arange(n, device=device)[:, None] + (m - n)  # the key column each query row is aligned to
        c = torch.arange(m, device=device)[None, :]
        allowed = torch.ones(n, m, dtype=torch.bool, device=device)
        if causal or right >= 0:
            allowed &= c <= diag + max(right, 0)
        if left >= 0:
            allowed &= c >= diag - left
        empty = ~allowed.any(-1, keepdim=True)
        p = torch.softmax(s.masked_fill(~allowed, -math.inf).masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
        outs.append((p @ vi).transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                           initial_state: Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
                           **kwargs) -> tuple[Tensor, Tensor | None]:
    """``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]`` (``g`` a log decay), ``initial_state
    [N, HV, K, V]`` -> ``(o [B, T, HV, V], final_state [N, HV, K, V] float32 | None)``; with ``cu_seqlens``
    (``[N + 1]``) ``B`` must be 1 and each sequence starts from its own initial state (zero if None).

    Per value head ``h`` (query/key head ``h // (HV / H)``) and token: ``S = exp(g) S``, ``S += k (beta (v -
    S^T k))^T``, ``o = S^T (scale q)``."""
    CALLS["chunk_gated_delta_rule"] += 1
    chunk = kwargs.pop("chunk_size", 64)
    _check(chunk in (16, 32, 64), f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk}.", ValueError)
    unsupported = {name for name, value in kwargs.items() if value is not None and value is not False}
    _check(not unsupported, f"emulation: {sorted(unsupported)} not emulated", NotImplementedError)
    for name, t, dims in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        _check(isinstance(t, Tensor) and t.dim() == dims, f"{name} must have {dims} dims, got "
               f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}", ValueError)
    _check(q.shape[2] == k.shape[2], f"q and k must have the same number of heads, but got q.shape[2]={q.shape[2]} and "
           f"k.shape[2]={k.shape[2]}", ValueError)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check(HV % H == 0, f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_heads (H={H}), but got HV % H = {HV % H}",
           ValueError)
    _check(tuple(k.shape) == (B, T, H, K), f"k must have q's shape {(B, T, H, K)}, got {tuple(k.shape)}", ValueError)
    _check(tuple(v.shape[:2]) == (B, T), f"v must be [{B}, {T}, HV, V], got {tuple(v.shape)}", ValueError)
    for name, t in (("g", g), ("beta", beta)):
        _check(tuple(t.shape) == (B, T, HV), f"{name} must have shape {(B, T, HV)}, got {tuple(t.shape)}", ValueError)
    _check(q.dtype in (torch.float32, *HALF), f"q must be float32, float16 or bfloat16 (Triton kernels), got {q.dtype}", ValueError)
    _check(k.dtype == q.dtype and v.dtype == q.dtype, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}", ValueError)
    _check(g.is_floating_point() and beta.is_floating_point(), "g and beta must be floating point", ValueError)
    device = q.device
    _check(all(t.device == device for t in (k, v, g, beta)), "all inputs must be on one device", ValueError)
    _check(K <= 256, "current kernel does not support head dimension larger than 256.", ValueError)
    if cu_seqlens is not None:
        _check(B == 1, f"The batch size is expected to be 1 rather than {B} when using `cu_seqlens`.Please flatten "
               "variable-length inputs before processing.", ValueError)
        _check(not cu_seqlens.is_floating_point() and cu_seqlens.dtype != torch.bool,
               f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}", ValueError)
        bounds = _check_cu(cu_seqlens, "cu_seqlens", T, device, None, ValueError)
        _check(all(b > a for a, b in zip(bounds, bounds[1:])), "cu_seqlens: every sequence must hold at least one token",
               ValueError)
        if initial_state is not None:
            _check(initial_state.shape[0] == len(bounds) - 1, "The number of initial states is expected to be equal to the "
                   f"number of input sequences, i.e., {len(bounds) - 1} rather than {initial_state.shape[0]}.", ValueError)
        spans = [(0, a, b) for a, b in zip(bounds, bounds[1:])]
    else:
        spans = [(b, 0, T) for b in range(B)]
    N = len(spans)
    if initial_state is not None:
        _check(tuple(initial_state.shape) == (N, HV, K, V), f"initial_state must have shape {(N, HV, K, V)}, got "
               f"{tuple(initial_state.shape)}", ValueError)
        _check(initial_state.device == device and initial_state.is_floating_point(),
               "initial_state must be a floating-point tensor on the inputs' device", ValueError)
    scale = K ** -0.5 if scale is None else float(scale)
    group = HV // H
    qd, kd = (t.double().repeat_interleave(group, 2) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        qd, kd = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (qd, kd))
    vd, gd, bd = v.double(), g.double(), beta.double()
    outs, finals = [], []
    for n, (row, a, b) in enumerate(spans):
        S = qd.new_zeros(HV, K, V) if initial_state is None else initial_state[n].double()
        for t in range(a, b):
            S = S * gd[row, t].exp()[:, None, None]
            kt = kd[row, t]  # [HV, K]
            delta = (vd[row, t] - torch.einsum("hkv,hk->hv", S, kt)) * bd[row, t][:, None]
            S = S + kt[:, :, None] * delta[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, qd[row, t] * scale))
        finals.append(S)
    o = torch.stack(outs).view(B, T, HV, V) if outs else vd.new_zeros(B, T, HV, V)
    final = torch.stack(finals).float() if output_final_state else None
    return o.to(q.dtype), final


def install() -> None:
    """Point blockdiag's CUDA branches at the emulations and let them take CPU tensors (until :func:`uninstall`)."""
    from blockdiag_dist.kernels import gated_delta, varlen

    if not hasattr(varlen, "_real_flash_fn"):
        varlen._real_flash_fn = (varlen._flash_varlen_fn, varlen.FLASH_DEVICE_TYPES, varlen._device_capability)
        gated_delta._real_fla = (gated_delta.fla_kernel, gated_delta.FLA_DEVICE_TYPES)
    varlen._flash_varlen_fn = lambda: flash_attn_varlen_func
    varlen.FLASH_DEVICE_TYPES = ("cuda", "cpu")
    varlen._device_capability = lambda device: (9, 0)  # an H200's
    gated_delta.fla_kernel = lambda: chunk_gated_delta_rule
    gated_delta.FLA_DEVICE_TYPES = ("cuda", "cpu")


def uninstall() -> None:
    from blockdiag_dist.kernels import gated_delta, varlen

    if hasattr(varlen, "_real_flash_fn"):
        varlen._flash_varlen_fn, varlen.FLASH_DEVICE_TYPES, varlen._device_capability = varlen._real_flash_fn
        gated_delta.fla_kernel, gated_delta.FLA_DEVICE_TYPES = gated_delta._real_fla
        del varlen._real_flash_fn, gated_delta._real_fla


def _counted(name: str, fn):
    def counted(*args, **kwargs):
        CALLS[name] += 1
        return fn(*args, **kwargs)
    return counted


def count_real_calls() -> None:
    """Where the real packages are used (a GPU): count their calls in :data:`CALLS` too (idempotent)."""
    from blockdiag_dist.kernels import gated_delta, varlen

    if getattr(varlen, "_counting", False):
        return
    real_flash, real_fla = varlen._flash_varlen_fn, gated_delta.fla_kernel
    varlen._flash_varlen_fn = lambda: None if real_flash() is None else _counted("flash_attn_varlen_func", real_flash())
    gated_delta.fla_kernel = lambda: None if real_fla() is None else _counted("chunk_gated_delta_rule", real_fla())
    varlen._counting = True


def for_device(device: str) -> str:
    """What a GPU-check step runs for flash-attn and fla on ``device``: the emulations on CPU (installed), the real
    packages, counted, on CUDA. Returns a line for the report."""
    if device == "cpu":
        install()
        return "emulated (verify.gpu.emulate, CPU dry run)"
    count_real_calls()
    from blockdiag_dist.kernels import gated_delta, varlen

    have = [name for name, fn in (("flash-attn", varlen._flash_varlen_fn()), ("fla", gated_delta.fla_kernel())) if fn is not None]
    return "real: " + (", ".join(have) if have else "neither flash-attn nor fla installed (their paths are not judged)")


def calls() -> dict[str, int]:
    """:data:`CALLS` as a plain dict (e.g. read from every rank of a pool)."""
    return dict(CALLS)


@contextlib.contextmanager
def emulated() -> Iterator[Counter]:
    """:func:`install` for the duration of a block; yields :data:`CALLS`."""
    install()
    try:
        yield CALLS
    finally:
        uninstall()
