"""The reference: per-document causal attention over packed rows, in float64.

Shape legend:
    B    batch rows      S    positions per row
    Hq   query heads     Hkv  key/value heads (Hq is a multiple of Hkv)
    D    head dim        Dv   value head dim
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .layout import DocLayout, normalize_temperature

__all__ = ["reference_attention", "temperature_scale"]


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layout: DocLayout | Tensor,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    window_size: Sequence[int] | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    temperature: Sequence[float] | None = None,
    bidirectional_blocks: Tensor | None = None,
    whole_blocks: bool = False,
) -> Tensor:
    """Per-document causal attention, computed in float64 and returned in ``query``'s dtype.

    Args:
        query: ``[B, Hq, S, D]``.
        key:   ``[B, Hkv, S, D]``.
        value: ``[B, Hkv, S, Dv]``.
        layout: a :class:`DocLayout` or doc ids ``[B, S]`` (0 = padding).
        scale: softmax scale, default ``1 / sqrt(D)``.
        enable_gqa: allow ``Hq != Hkv`` (``Hq`` a multiple of ``Hkv``), as in
            ``torch.nn.functional.scaled_dot_product_attention``.
        window_size: ``(left, right)`` with flash-attn's meaning inside each document; ``right <= 0``.
        sinks: ``[Hq]`` attention sinks (gpt-oss): one learned logit per head that joins every query's softmax
            denominator with no value, ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h]))``. Differentiable.
        softcap: logit soft-capping (Gemma 2): scores become ``softcap * tanh(scores / softcap)`` before the
            mask and the softmax.
        chunk_size: chunked local attention (Llama 4): a query sees only keys of its own chunk of
            ``chunk_size`` positions, chunks counted from its document's start.
        temperature: ``(floor_scale, attn_scale)``: Llama 4's NoPE query temperature. Each query is multiplied by
            :func:`temperature_scale` of its position inside its document before the scores.
        bidirectional_blocks: int ``[B, S]`` block ids (0 = none): a query in a block also sees the later keys
            of its block in its document (Gemma 3's images; :meth:`DocLayout.materialize_mask`).
        whole_blocks: with ``bidirectional_blocks``, a query in a block sees every key of its block, the earlier
            ones beyond the window too: the causal window OR the block (Gemma 4's and PaliGemma's sliding layers).

    Returns:
        ``[B, Hq, S, Dv]``. Rows at padding positions are exactly 0, and no gradient reaches keys or values
        at padding positions. Differentiable in ``query``, ``key`` and ``value``. Slow: it materializes the
        ``[B, 1, S, S]`` mask and the scores. With sinks the padding rows are 0 too, and give the sinks no
        gradient.

    Autocast is off inside; float64 matmuls never use TF32.

    >>> q = k = v = torch.ones(1, 1, 3, 2)
    >>> reference_attention(q, k, v, torch.tensor([[1, 1, 0]]))[0, 0]
    tensor([[1., 1.],
            [1., 1.],
            [0., 0.]])
    """
    layout = layout if isinstance(layout, DocLayout) else DocLayout.from_doc_ids(layout)
    _check_qkv(query, key, value, layout, enable_gqa)
    _check_variants(query, sinks, softcap)
    allowed = layout.materialize_mask(window_size=window_size, chunk_size=chunk_size,
                                      bidirectional_blocks=bidirectional_blocks,
                                      whole_blocks=whole_blocks).to(query.device)  # [B, 1, S, S]
    D = query.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    group = query.shape[1] // key.shape[1]
    temperature = normalize_temperature(temperature)
    with torch.autocast(device_type=query.device.type, enabled=False):
        q = query.to(torch.float64)
        if temperature is not None:
            q = q * temperature_scale(layout.doc_positions, *temperature).to(q.device)[:, None, :, None]
        k = key.to(torch.float64).repeat_interleave(group, dim=1)
        v = value.to(torch.float64).repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        has_key = allowed.any(dim=-1, keepdim=True)  # False on padding rows
        # Rows with no visible key get finite scores (all 0) so that softmax stays NaN-free, then exactly 0.
        scores = scores.masked_fill(~allowed & has_key, float("-inf")).masked_fill(~has_key, 0.0)
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # one more logit per row, with no value: it takes its share of the denominator, then is dropped
            sink = sinks.to(torch.float64).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        probs = torch.where(has_key, probs, 0.0)
        out = torch.matmul(probs, v)
    return out.to(query.dtype)


def temperature_scale(positions: Tensor, floor_scale: float, attn_scale: float) -> Tensor:
    """Llama 4's NoPE query temperature for positions ``t`` inside their documents: float32 (any shape, on the CPU)
    ``log1p(floor((t + 1) / floor_scale)) * attn_scale + 1``, computed in float32 on the CPU exactly as
    ``Llama4TextAttention`` computes it (so that a float64 model agrees with the stock one to float64 rounding);
    1 where ``t < 0`` (padding).

    >>> temperature_scale(torch.tensor([-1, 0, 1]), 2, 0.5)
    tensor([1.0000, 1.0000, 1.3466])
    """
    t = positions.detach().to("cpu", torch.int64)
    scale = torch.log1p(torch.floor((t.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return torch.where(t >= 0, scale, torch.ones((), dtype=torch.float32))


def _check_variants(query: Tensor, sinks: Tensor | None, softcap: float | None) -> None:
    if sinks is not None:
        if not isinstance(sinks, Tensor) or sinks.dim() != 1 or sinks.shape[0] != query.shape[1]:
            got = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            raise ValueError(f"sinks: expected a tensor [Hq] = [{query.shape[1]}] (one logit per query head), got {got}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap: expected None or a number > 0, got {softcap!r}")


def _check_qkv(query: Tensor, key: Tensor, value: Tensor, layout: DocLayout, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [B, H, S, D], got shape {tuple(t.shape)}")
    B, S = layout.batch_size, layout.seq_len
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.shape[0] != B or t.shape[2] != S:
            raise ValueError(f"{name}: expected B={B} and S={S} from the layout, got shape {tuple(t.shape)}")
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key/value: expected the same [B, Hkv, S], got {tuple(key.shape)} and {tuple(value.shape)}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query/key: expected the same head dim D, got {query.shape[-1]} and {key.shape[-1]}")
    hq, hkv = query.shape[1], key.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"heads: expected Hq a multiple of Hkv, got Hq={hq}, Hkv={hkv}")
    if hq != hkv and not enable_gqa:
        raise ValueError(f"heads: Hq={hq} != Hkv={hkv} needs enable_gqa=True (as in scaled_dot_product_attention)")
