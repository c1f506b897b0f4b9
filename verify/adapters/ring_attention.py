"""lucidrains ``ring-attention-pytorch`` (``==0.5.20``, ``make peers``) behind the seed's API.

The adapter calls ``ring_flash_attn(q, k, v, mask=None, causal=True, ring_reduce_col=CP > 1)`` — the CPU
path ``RingAttention.forward`` takes for a causal layer with ring attention — on contiguous shards of equal
length (ring passing needs one shape on every rank; the adapter pads S to a multiple of the CP size, after
the last token, which no causal query sees). Layout ``[B, L, H, D]`` is what the library takes; the adapter
transposes.

Conventions (the library models one causal sequence per row; with ``causal=True`` the key mask is
ignored, as its code says): document = the whole row; padding rows are ordinary tokens (not zeroed);
doc ids in any source are not read; B > 1 is native; GQA pairs query head j with key/value head j mod Hkv
(the adapter reorders query heads to SDPA's pairing, j // (Hq / Hkv)); CP 1 is a one-member ring; no windows
(``max_lookback_seq_len`` is a bucket-granular lookback, not a per-token window).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .conventions import Conventions
from .peer import ActiveStep, import_peer, start_batch

__all__ = ["CONVENTIONS", "UNAVAILABLE", "VERSION", "cp_blockdiag_sdpa", "make_cp_blockdiag_batch_and_ctx"]

def _load():
    from ring_attention_pytorch import ring_flash_attn

    return ring_flash_attn


_ring_flash_attn, VERSION, UNAVAILABLE = import_peer(_load, "ring-attention-pytorch")

CONVENTIONS = Conventions(
    document="row",
    padding="free",
    mask4d="documents",
    batch_rows="any",
    cp1="a ring of one rank (no communication)",
    layouts="contiguous shards, S padded to a multiple of CP",
    windows="none",
    notes=(
        "the CPU path is ring_flash_attn, the pure-PyTorch flash/ring kernel (the CUDA kernel needs triton).",
        "source of 0.5.20, RingFlashAttentionFunction.backward: the last `dkv = ring_pass(..., dkv)` returns the "
        "pair (received, sent), each a stacked [2, B, L, H, D] (dk, dv) tensor, and `dk, dv = dkv` unpacks that "
        "pair; autograd sums each [2, ...] gradient to k's shape. CP 1 takes no ring pass (ring_reduce_col off).",
        "source of 0.5.20, forward: row sums and maxima are allocated in the default dtype (float32) and filled "
        "with -finfo(q.dtype).max; for float64 inputs torch.full raises RuntimeError (overflow).",
    ),
)

_SEQ_KEYS = {"inputs_embeds": 0, "input_ids": 0, "labels": -100, "position_ids": 0, "_packed_seq_ids": 0,
             "loss_mask": 0}
_active = ActiveStep()


def make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch: dict[str, Any], loss_mask: Tensor | None = None,
                                    padding_token_id: int = 0):
    """Pad the sequence to a multiple of the CP size and keep this rank's contiguous shard."""
    if _ring_flash_attn is None:
        raise ImportError(UNAVAILABLE)
    world, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    _, B, S, _ = start_batch(batch, loss_mask)
    L = math.ceil(S / world)
    pad = L * world - S
    fills = {**_SEQ_KEYS, "input_ids": padding_token_id, "padding_mask": True}
    for key, fill in fills.items():
        t = batch.get(key)
        if not isinstance(t, Tensor) or t.dim() < 2:
            continue
        if pad:
            t = torch.cat([t, torch.full((B, pad, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)], dim=1)
        batch[key] = t[:, rank * L:(rank + 1) * L]
    return _active.train_ctx(world=world), batch


def cp_blockdiag_sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False) -> Tensor:
    """``[B, H, L, D]`` in and out; causal ring attention over the CP group (the default process group)."""
    if _ring_flash_attn is None:
        raise ImportError(UNAVAILABLE)
    if not _active:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
    if scale is not None and scale != query.shape[-1] ** -0.5:
        raise ValueError(f"ring_flash_attn uses scale = D ** -0.5 = {query.shape[-1] ** -0.5}, got scale={scale}")
    B, Hq, L, D = query.shape
    Hkv = key.shape[1]
    g = Hq // Hkv
    # the library pairs query head j with key/value head j % Hkv (einops '(g h)'); SDPA pairs j with j // g
    q = query.view(B, Hkv, g, L, D).transpose(1, 2).reshape(B, Hq, L, D)
    q, k, v = (t.transpose(1, 2) for t in (q, key, value))
    world = _active["world"]  # RingAttention.forward reduces around the ring only when distributed (world > 1)
    out = _ring_flash_attn(q, k, v, None, True, 1024, world > 1, False, None, world).transpose(1, 2)
    return out.reshape(B, g, Hkv, L, D).transpose(1, 2).reshape(B, Hq, L, D)
