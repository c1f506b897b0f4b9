"""``cp_blockdiag_sdpa``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention`` that, while a
step context is active, computes per-document causal attention over the CP-sharded sequence.

Shape legend: B batch rows, L rows held by this rank, Hq / Hkv heads, D / Dv head dims, Tq = B * L.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from blockdiag_ref import normalize_chunk, normalize_temperature, normalize_window, temperature_scale

from ._stock import stock_sdpa
from .binding import bind_output, bind_reentrant_forward, in_backward, recompute_state
from .kernels.dense import dense_attention
from .kernels.explicit import explicit_attention
from .kernels.varlen import flash_unusable_reason, varlen_attention
from .state import StepState, current_state, last_exited_state

__all__ = ["cp_blockdiag_sdpa", "sdpa_routing"]

SINKS_NOT_FLASH = "attention sinks: flash-attn's varlen function has none"
BLOCKS_NOT_FLASH = "bidirectional blocks: flash-attn's varlen function is causal or not, per sequence"
NONCAUSAL = ("raise", "causal", "local")  # what a non-causal call does under a step (see cp_blockdiag_sdpa)


# torch.compile: one graph break at each call instead of tracing into the step state (a lock, a per-step object
# that would be guarded on and recompiled every step) and the exchanges' collectives; runs eagerly, compiled
# code before and after it is kept.
@torch.compiler.disable(reason="cp_blockdiag_sdpa reads the per-step CP state and runs collectives")
def cp_blockdiag_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window_size: Sequence[int] | None = None,
    *,
    noncausal: str = "raise",
    sinks: Tensor | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    temperature: Sequence[float] | None = None,
    bidirectional_blocks: Tensor | bool | None = None,
    whole_blocks: bool = False,
) -> Tensor:
    """Scaled dot-product attention, per document and across CP ranks while a step context is active.

    With no active context this is exactly ``torch.nn.functional.scaled_dot_product_attention``; a
    ``window_size`` (or ``chunk_size``) there becomes a bottom-right-aligned causal band (in place of
    ``is_causal``) combined with ``attn_mask``, and the variants below are computed with explicit scores.

    Attention variants (keyword-only; the same math with or without a step, and at every CP size):

    - ``sinks [Hq]``: attention sinks (gpt-oss' ``s_aux``): one learned logit per query head joins every
      query's softmax denominator, with no value: ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h]))``.
      Differentiable; each rank's gradient covers its own queries (summed over the CP group like every other
      parameter's).
    - ``softcap``: logit soft-capping (Gemma 2): scores become ``softcap * tanh(scores / softcap)`` before the
      mask and the softmax.
    - ``chunk_size``: chunked local attention (Llama 4): a query sees only the keys of its own chunk of
      ``chunk_size`` positions of its document, chunks counted from the document's start (outside a step: from
      the first key of the row). Combines with ``window_size``.
    - ``temperature=(floor_scale, attn_scale)``: Llama 4's NoPE query temperature: each query is multiplied by
      ``log1p(floor((t + 1) / floor_scale)) * attn_scale + 1`` for its position ``t`` inside its document (outside
      a step: its position in the row, bottom-right aligned to the keys, as ``Llama4TextAttention`` computes it),
      the scale in float32 as the model computes it (:func:`blockdiag_ref.temperature_scale`); the query's
      gradient carries it.
    - ``bidirectional_blocks``: bidirectional blocks (Gemma 3's image tokens, PaliGemma's prefix): a query in a
      block also sees every later key of its block, in its document; a window bounds only the keys before the
      query. Under a step: ``True``, the step's blocks (the batch function's ``bidirectional_blocks``, or
      ``train_ctx.state.set_bidirectional_blocks``; a block crossing a rank edge brings the later keys from the
      ranks that hold them, needed-only, and returns their gradients). Without a step: block ids ``[B, Lk]`` of
      the keys (0 = none), queries bottom-right aligned. Not combined with ``chunk_size``.
    - ``whole_blocks``: with ``bidirectional_blocks``, a query in a block sees every key of its block, the earlier
      ones beyond the window too: the causal window OR the block (Gemma 4's and PaliGemma's sliding layers; without
      it the window bounds the keys of the block before the query, as Gemma 3's sliding layers do). Under a step
      the block's keys before the window come from the ranks that hold them, needed-only.

    With an active context (``with train_ctx():``): ``query [B, Hq, L, D]``, ``key [B, Hkv, L, D]`` and
    ``value [B, Hkv, L, Dv]`` are this rank's rows; the result ``[B, Hq, L, Dv]`` is causal attention inside
    each document over the whole (sharded) sequence. A call must be causal (``is_causal=True``, a
    ``window_size`` or a ``chunk_size``, no ``attn_mask``); any other raises ``ValueError`` unless ``noncausal``
    opts in: ``"causal"`` computes per-document causal attention anyway (a causal decoder passing its own mask; the
    replacement is recorded in the state's notes), ``"local"`` runs stock SDPA on the tensors as given, with
    their mask (attention over tensors CP does not shard: encoders, vision towers, cross-attention; recorded
    too). Bidirectional attention per document is not offered. ``scale``, ``enable_gqa`` and
    ``window_size=(left, right <= 0)`` are honoured. ``dropout_p > 0`` uses torch's RNG
    inside the kernel: it trains as SDPA dropout does, but no reference can reproduce its draws. Padding rows
    are exactly 0; keys and values at padding positions get exactly 0 gradient. Under ``torch.autocast``,
    q/k/v are cast as autocast casts them for stock SDPA (to the autocast dtype, float64 excepted), so that
    e.g. float32 q/k after RoPE and a bf16 v are accepted, and the output has the autocast dtype.
    """
    state = _step_of_call(query)
    if state is not None:
        state.attention_calls += 1
    if noncausal not in NONCAUSAL:
        raise ValueError(f"cp_blockdiag_sdpa: noncausal expected one of {NONCAUSAL}, got {noncausal!r}")
    chunk = normalize_chunk(chunk_size)
    temp = normalize_temperature(temperature)
    variants = sinks is not None or softcap is not None or chunk > 0
    if variants:
        _check_variants(query, sinks, softcap)
    bidirectional = _check_blocks(bidirectional_blocks, state, key, chunk)
    if not isinstance(whole_blocks, bool) or (whole_blocks and not bidirectional):
        raise ValueError(f"cp_blockdiag_sdpa: whole_blocks expected a bool, True only with bidirectional_blocks, got "
                         f"{whole_blocks!r} with bidirectional_blocks={'given' if bidirectional else None}")
    if state is None and bidirectional:
        if not is_causal and window_size is None:
            raise ValueError(
                "cp_blockdiag_sdpa: bidirectional_blocks: expected is_causal=True (or a window_size): the blocks widen "
                "causal attention by the later keys of each query's block, got is_causal=False without a window "
                "(plain bidirectional attention: call without bidirectional_blocks)"
            )
        query = _with_temperature(query, key, temp, None)
        return _single_device_blocks(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
                                     sinks, softcap, bidirectional_blocks, whole_blocks)
    if state is None:
        query = _with_temperature(query, key, temp, None)
        if variants:
            return _single_device(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
                                  sinks, softcap, chunk)
        if window_size is not None:
            attn_mask = _with_band(query, key, attn_mask, normalize_window(window_size))
            is_causal = False
        return stock_sdpa(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )
    if attn_mask is not None or not (is_causal or window_size is not None or chunk > 0):
        if _non_causal_call(state, query, attn_mask, is_causal, noncausal) == "local":
            query = _with_temperature(query, key, temp, None)
            if variants:  # as without a step: on the tensors as given, with their mask
                return _single_device(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
                                      sinks, softcap, chunk)
            return stock_sdpa(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa,
            )
    left = normalize_window(window_size)
    query, key, value = _autocast_like_sdpa(query, key, value)
    _check_inputs(state, query, key, value, enable_gqa, dropout_p)
    called_query = query  # what the call's autograd nodes start from (bind_output)
    query = _with_temperature(query, key, temp, state)
    wp = state.agreed_window_plan(left, chunk, bidirectional, whole_blocks)
    state.attention_kinds.add((left, chunk, sinks is not None, None if softcap is None else float(softcap)))
    B, Hq, L, D = query.shape
    Hkv, Dv = key.shape[1], value.shape[-1]
    kv_tok = torch.cat(
        [key.transpose(1, 2).reshape(B * L, Hkv * D), value.transpose(1, 2).reshape(B * L, Hkv * Dv)], dim=1
    )
    kv_buf = state.exchange(kv_tok, wp)  # [Tk, Hkv * (D + Dv)]
    q_tok = query.transpose(1, 2).reshape(B * L, Hq, D)
    if state.kernel == "dense":
        out = dense_attention(q_tok, kv_buf, wp.kernel_meta, heads_kv=Hkv, dim_v=Dv, dropout_p=dropout_p, scale=scale,
                              sinks=sinks, softcap=softcap)
    else:
        sequences = int(wp.kernel_meta.piece_q.shape[0])
        every_piece_blocked = wp.kernel_meta.labels is not None and wp.kernel_meta.plain is None
        why_not = SINKS_NOT_FLASH if sinks is not None else BLOCKS_NOT_FLASH if every_piece_blocked else flash_unusable_reason(
            q_tok, D, Dv, dropout_p=dropout_p, softcap=softcap, sequences=sequences)
        if why_not is not None and q_tok.device.type == "cuda" and sequences:  # padding only: zeros, nothing runs
            state.note(f"varlen kernel: flash-attn not used ({why_not}); batched SDPA per size class instead")
        out = varlen_attention(
            q_tok, kv_buf, wp.kernel_meta, heads_kv=Hkv, dim_v=Dv, dropout_p=dropout_p, scale=scale,
            use_flash=why_not is None, sinks=sinks, softcap=softcap,
        )
    if torch.is_grad_enabled():
        bind_output(out, (called_query, key, value) + (() if sinks is None else (sinks,)), state)
    return out.view(B, L, Hq, Dv).transpose(1, 2)


def _check_variants(query: Tensor, sinks: Tensor | None, softcap: float | None) -> None:
    if sinks is not None:
        heads = query.shape[1] if isinstance(query, Tensor) and query.dim() == 4 else None
        if not isinstance(sinks, Tensor) or sinks.dim() != 1 or (heads is not None and sinks.shape[0] != heads):
            got = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            raise ValueError(f"cp_blockdiag_sdpa: sinks expected a tensor [Hq] = [{heads}] (one logit per query head), got {got}")
        if not sinks.is_floating_point():
            raise ValueError(f"cp_blockdiag_sdpa: sinks expected a floating-point tensor, got dtype {sinks.dtype}")
        if isinstance(query, Tensor) and sinks.device != query.device:
            raise ValueError(f"cp_blockdiag_sdpa: sinks expected on the query's device {query.device}, got {sinks.device}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"cp_blockdiag_sdpa: softcap expected None or a number > 0, got {softcap!r}")


def _check_blocks(blocks: Tensor | bool | None, state: StepState | None, key: Tensor, chunk: int) -> bool:
    """Whether the call has bidirectional blocks (validated: ``True`` under a step, ids ``[B, Lk]`` without)."""
    if blocks is None or blocks is False:
        return False
    if chunk > 0:
        raise ValueError(f"cp_blockdiag_sdpa: bidirectional_blocks expected without chunk_size, got chunk_size={chunk}")
    if state is not None:
        if blocks is not True:
            got = f"a tensor of shape {tuple(blocks.shape)}" if isinstance(blocks, Tensor) else repr(blocks)
            raise ValueError(
                "cp_blockdiag_sdpa: bidirectional_blocks expected True under a CP step (the step's blocks, given to "
                f"make_cp_blockdiag_batch_and_ctx(bidirectional_blocks=...) for the full rows), got {got}")
        if state.blocks is None:
            raise ValueError(
                "cp_blockdiag_sdpa: bidirectional_blocks=True expected the step's blocks, got a step without any (give "
                "them to make_cp_blockdiag_batch_and_ctx(bidirectional_blocks=...) or state.set_bidirectional_blocks)")
        return True
    shape = (key.shape[0], key.shape[-2]) if isinstance(key, Tensor) and key.dim() == 4 else None
    if not isinstance(blocks, Tensor) or blocks.is_floating_point() or tuple(blocks.shape) != shape:
        got = (tuple(blocks.shape), blocks.dtype) if isinstance(blocks, Tensor) else repr(blocks)
        raise ValueError(f"cp_blockdiag_sdpa: bidirectional_blocks expected (without a step) integer block ids of the "
                         f"keys [B, Lk] = {list(shape) if shape else '[B, Lk]'}, got {got}")
    return True


def _single_device_blocks(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size, sinks,
                          softcap, blocks: Tensor, whole: bool = False) -> Tensor:
    """Bidirectional blocks on the tensors as given (no step): the causal band (with the window) or a later key of
    the query's block (with ``whole``: any key of it; ids ``[B, Lk]``, queries bottom-right aligned), and
    ``attn_mask`` if given."""
    query, key, value = _autocast_like_sdpa(query, key, value)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"cp_blockdiag_sdpa: Hq={query.shape[1]} != Hkv={key.shape[1]} needs enable_gqa=True (as in SDPA)")
    left = -1 if window_size is None else normalize_window(window_size)
    Lq, Lk = query.shape[-2], key.shape[-2]
    i = torch.arange(Lq, device=query.device)[:, None] + (Lk - Lq)
    j = torch.arange(Lk, device=query.device)[None, :]
    band = (j <= i) & ((j >= i - left) if left >= 0 else True)
    ids = blocks.to(query.device)
    lab_q, lab_k = ids[:, Lk - Lq:, None], ids[:, None, :]
    same = (lab_q == lab_k) & (lab_q != 0)
    allowed = (band[None] | (same if whole else same & (j > i)[None]))[:, None]  # [B, 1, Lq, Lk]
    if attn_mask is not None:
        allowed = allowed & attn_mask if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~allowed, float("-inf"))
    if sinks is not None or softcap is not None:
        return explicit_attention(query, key, value, allowed, scale=scale, softcap=softcap, sinks=sinks, dropout_p=dropout_p)
    return stock_sdpa(query, key, value, attn_mask=allowed, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)


def _with_temperature(query: Tensor, key: Tensor, temperature: tuple[float, float] | None, state: StepState | None) -> Tensor:
    """``query [B, Hq, L, D]`` times the NoPE temperature of each query's position: inside its document under a
    step (from the step's plan, computed once per step on the host), else in its row (bottom-right aligned to
    ``key``, as the model computes it). Multiplied in float32 or wider, returned in the query's dtype."""
    if temperature is None:
        return query
    if not isinstance(query, Tensor) or query.dim() != 4 or not isinstance(key, Tensor) or key.dim() < 2:
        got = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
        raise ValueError(f"cp_blockdiag_sdpa: temperature expected a query [B, H, L, D], got {got}")
    if state is None:
        Lq, Lk = query.shape[-2], key.shape[-2]
        scale = temperature_scale(torch.arange(Lk - Lq, Lk)[None, :], *temperature).to(query.device)
    else:
        scale = state.mixer_plan(("temperature", *temperature), lambda: temperature_scale(
            state.docs.doc_position_cpu, *temperature).to(state.device))
    return (query * scale[:, None, :, None]).to(query.dtype)


def _single_device(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size, sinks, softcap,
                   chunk: int) -> Tensor:
    """The variants on the tensors as given (no step): explicit scores, masked as stock SDPA would be (a window or
    chunks: a bottom-right-aligned causal band in place of ``is_causal``), with the same GQA rule."""
    query, key, value = _autocast_like_sdpa(query, key, value)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"cp_blockdiag_sdpa: Hq={query.shape[1]} != Hkv={key.shape[1]} needs enable_gqa=True (as in SDPA)")
    if window_size is not None or chunk > 0:
        left = -1 if window_size is None else normalize_window(window_size)
        attn_mask = _with_band(query, key, attn_mask, left, chunk)
        is_causal = False
    return explicit_attention(query, key, value, attn_mask, causal=is_causal, scale=scale, softcap=softcap, sinks=sinks,
                              dropout_p=dropout_p)


def _non_causal_call(state: StepState, query: Tensor, attn_mask: Tensor | None, is_causal: bool, noncausal: str) -> str:
    """What a call that is not plainly causal does under a step: raise, or the opted-in ``noncausal`` mode."""
    what = f"is_causal={is_causal}" + ("" if attn_mask is None else f" with an attn_mask of shape {tuple(attn_mask.shape)}")
    if noncausal == "raise":
        raise ValueError(
            f"cp_blockdiag_sdpa: expected causal attention under an active CP step (is_causal=True or a window_size, "
            f"no attn_mask), got {what}; block-diagonal CP computes causal attention per document. Opt in with "
            "noncausal='causal' (per-document causal attention replaces it: a causal decoder passing its own mask) "
            "or noncausal='local' (stock SDPA on this rank's tensors as given: encoders, vision towers, "
            "cross-attention over tensors CP does not shard), on the call or on sdpa_routing()"
        )
    if noncausal == "causal":
        state.note(f"cp_blockdiag_sdpa: {what} replaced by per-document causal attention (noncausal='causal')")
    else:
        state.note(f"cp_blockdiag_sdpa: {what} ran stock SDPA on local tensors of shape {tuple(query.shape)} (noncausal='local')")
    return noncausal


def _step_of_call(query: Tensor) -> StepState | None:
    """The step this call computes under: in a checkpoint recompute (during backward), the step its forward
    used, found in the autograd graph; otherwise the active one (None: stock SDPA)."""
    if in_backward():
        bound = recompute_state()
        if bound is not None:
            return bound
        state = current_state()
        if state is None:
            _refuse_recompute_outside_context(query)
        else:
            state.note("a recompute found no step in its autograd graph (its forward left none): the active step was used")
        return state
    state = current_state()
    if state is not None and not torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
        bind_reentrant_forward(state)
    return state


def _autocast_like_sdpa(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Cast q/k/v as autocast casts them for stock SDPA (a lower-precision op on CPU and CUDA): while autocast
    is on for their device type, every floating tensor but float64 goes to the autocast dtype. Outside
    autocast they are returned unchanged (and must share one dtype, as SDPA requires)."""
    device_type = q.device.type if isinstance(q, Tensor) else None
    if device_type is None or not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: Tensor) -> Tensor:
        eligible = isinstance(t, Tensor) and t.device.type == device_type and t.is_floating_point()
        return t.to(dtype) if eligible and t.dtype != torch.float64 else t

    return cast(q), cast(k), cast(v)


def _check_inputs(state: StepState, q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool, dropout_p: float) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"cp_blockdiag_sdpa: {name} expected 4 dims [B, H, L, D], got {got}")
    B, L = state.batch_size, state.local_len
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.shape[0] != B or t.shape[2] != L:
            raise ValueError(
                f"cp_blockdiag_sdpa: {name} expected this rank's shard [B={B}, H, L={L}, D] of the active step, "
                f"got {tuple(t.shape)}"
            )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"cp_blockdiag_sdpa: key and value expected the same Hkv, got {k.shape[1]} and {v.shape[1]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"cp_blockdiag_sdpa: query and key expected the same head dim D, got {q.shape[-1]} and {k.shape[-1]}")
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"cp_blockdiag_sdpa: expected Hq a multiple of Hkv, got Hq={hq}, Hkv={hkv}")
    if hq != hkv and not enable_gqa:
        raise ValueError(f"cp_blockdiag_sdpa: Hq={hq} != Hkv={hkv} needs enable_gqa=True (as in SDPA)")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(
            f"cp_blockdiag_sdpa: expected one dtype for query/key/value, got {q.dtype}, {k.dtype}, {v.dtype} "
            "(as stock SDPA outside autocast; under torch.autocast they are cast to its dtype)"
        )
    devices = {q.device, k.device, v.device}
    if len(devices) != 1:
        raise ValueError(f"cp_blockdiag_sdpa: expected one device for query/key/value, got {sorted(map(str, devices))}")
    if q.device != state.device:
        raise ValueError(f"cp_blockdiag_sdpa: expected tensors on the batch's device {state.device}, got {q.device}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"cp_blockdiag_sdpa: expected 0 <= dropout_p <= 1, got {dropout_p}")


def _refuse_recompute_outside_context(query: Tensor) -> None:
    """A recompute in backward whose forward left no step in the autograd graph, with no context active: if it
    looks like the last step's shard, stock SDPA would silently attend across documents; refuse instead."""
    state = last_exited_state()
    if state is None:
        return
    if query.dim() == 4 and query.shape[0] == state.batch_size and query.shape[2] == state.local_len:
        raise RuntimeError(
            "cp_blockdiag_sdpa: called during backward (an activation-checkpoint recompute) whose forward left "
            "no step state in the autograd graph, after the step's train_ctx() exited; expected backward to run "
            "inside `with train_ctx():`, got no active step state"
        )


def _with_band(query: Tensor, key: Tensor, attn_mask: Tensor | None, left: int, chunk: int = -1) -> Tensor:
    """Stock-SDPA mask with a causal window (it replaces ``is_causal``): query ``i``, bottom-right aligned,
    sees keys ``i - left .. i`` (and, with chunks, only those of its chunk of ``chunk`` keys, counted from key
    0); combined with ``attn_mask`` if one is given."""
    Lq, Lk = query.shape[-2], key.shape[-2]
    i = torch.arange(Lq, device=query.device)[:, None] + (Lk - Lq)
    j = torch.arange(Lk, device=query.device)[None, :]
    band = (j <= i) & ((j >= i - left) if left >= 0 else True)
    if chunk > 0:
        band = band & (j // chunk == i // chunk)
    if attn_mask is None:
        return band
    if attn_mask.dtype == torch.bool:
        return attn_mask & band
    return attn_mask.masked_fill(~band, float("-inf"))


@contextlib.contextmanager
def sdpa_routing(*, noncausal: str = "raise") -> Iterator[None]:
    """Rebind ``torch.nn.functional.scaled_dot_product_attention`` to :func:`cp_blockdiag_sdpa` for the block,
    so that an unmodified model routes its attention through it; the original is restored on exit.
    ``noncausal`` is given to every routed call (``"local"``: bidirectional layers, e.g. a vision tower, run
    stock SDPA on their own tensors while causal ones attend per document).

    Only calls that look the function up on ``torch.nn.functional`` at call time are rerouted (a name bound
    with ``from torch.nn.functional import scaled_dot_product_attention`` before entry is not; a step that
    saw no routed call raises at its context's exit).
    """
    if noncausal not in NONCAUSAL:
        raise ValueError(f"sdpa_routing: noncausal expected one of {NONCAUSAL}, got {noncausal!r}")
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = (
        cp_blockdiag_sdpa if noncausal == "raise" else functools.partial(cp_blockdiag_sdpa, noncausal=noncausal)
    )
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
