"""PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` (in torch itself) behind the seed's API.

As its docstring says: inside ``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` the buffers are
sharded along the sequence (head-tail load balanced when S is a multiple of 2 x CP, which the adapter pads
to) and ``torch.nn.functional.scaled_dot_product_attention`` is replaced by a ring attention. The adapter
shards ``position_ids`` through ``context_parallel`` itself and gathers every other batch tensor at those
positions (a differentiable gather, so gradients reach ``inputs_embeds``); the attention call is plain
``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` inside the context.

Conventions: one causal sequence per row (SDPA's ``is_causal``; no per-document mask), padding rows not
zeroed, B > 1 and GQA native, no windows. On CPU, torch 2.13 dispatches SDPA to
``aten._scaled_dot_product_flash_attention_for_cpu``, which the CP dispatcher has no rule for: it raises
NotImplementedError (the conformance report quotes it).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from .conventions import Conventions
from .peer import ActiveStep, import_peer, start_batch

__all__ = ["CONVENTIONS", "UNAVAILABLE", "VERSION", "cp_blockdiag_sdpa", "make_cp_blockdiag_batch_and_ctx"]

def _load():
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel


_context_parallel, VERSION, UNAVAILABLE = import_peer(
    _load, "torch", version=lambda: f"torch {torch.__version__}", missing=f"torch {torch.__version__} has no context_parallel"
)

CONVENTIONS = Conventions(
    document="row",
    padding="free",
    mask4d="documents",
    batch_rows="any",
    cp1="a mesh of one rank",
    devices=("cuda",),
    layouts="head-tail load balanced shards (S padded to a multiple of 2 x CP)",
    windows="none",
    notes=("CPU: SDPA's CPU flash kernel has no context-parallel rule in torch 2.13 (NotImplementedError)",),
)

_FILLS = {"inputs_embeds": 0, "input_ids": 0, "labels": -100, "_packed_seq_ids": 0, "loss_mask": 0,
          "padding_mask": True}
_active = ActiveStep()


def make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch: dict[str, Any], loss_mask: Tensor | None = None,
                                    padding_token_id: int = 0):
    """Shard ``position_ids`` with ``context_parallel`` and gather the batch at this rank's positions."""
    world = cp_mesh.size()
    primary, B, S, _ = start_batch(batch, loss_mask)
    device = primary.device
    S_full = -(-S // (2 * world)) * (2 * world)
    positions = torch.arange(S_full, device=device).expand(B, S_full).contiguous()
    with _context_parallel(cp_mesh, buffers=[positions], buffer_seq_dims=[1], no_restore_buffers={positions}):
        pass
    pos = positions[0]  # [L] global positions of this rank's rows (the same in every row)
    fills = {**_FILLS, "input_ids": padding_token_id}
    for key, fill in fills.items():
        t = batch.get(key)
        if isinstance(t, Tensor) and t.dim() >= 2:
            if S_full > S:
                t = torch.cat([t, torch.full((B, S_full - S, *t.shape[2:]), fill, dtype=t.dtype, device=device)], 1)
            batch[key] = t.index_select(1, pos)
    batch["position_ids"] = positions

    active = _active.train_ctx(on=True)

    @contextlib.contextmanager
    def train_ctx():
        dummy = torch.zeros(1, S_full, device=device)  # same length: the same load balancer as above
        with _context_parallel(cp_mesh, buffers=[dummy], buffer_seq_dims=[1], no_restore_buffers={dummy}), active():
            yield

    return train_ctx, batch


def cp_blockdiag_sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False) -> Tensor:
    """Inside the context: torch's CP ring attention, causal over the row."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout_p, is_causal=bool(_active) or is_causal,
        attn_mask=None if _active else attn_mask, scale=scale, enable_gqa=enable_gqa)
