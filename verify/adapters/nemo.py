"""NeMo Automodel's ``blockdiag_cp`` (``nemo-automodel==0.7.0``, ``make peers``) behind the seed's API.

At CP > 1: ``make_cp_blockdiag_batch_and_ctx`` (its third return value, the ``ShardLayout``, is dropped) and
``cp_blockdiag_sdpa``, called as its docstrings say. At CP 1 NeMo's batch function is a no-op by design and a
model reaches per-document attention through ``attach_cp1_packed_varlen_hooks`` +
``enable_cp1_packed_varlen``: the adapter does the same, on a one-module "model" whose ``self_attn`` calls
``torch.nn.functional.scaled_dot_product_attention``. On CPU the varlen backend is unavailable and NeMo
falls back to its dense masked SDPA on both paths (its documented fallback).

Conventions, from NeMo's docstrings and code (``batch.py``, ``kernels._cp_blockdiag_mask``):
document = every token sharing an id; padding rows attend to themselves (not zeroed: "harmless self-edge
whose output is dropped by the -100 labels"); a 4-D ``attention_mask`` gives validity only (its diagonal);
local batch size 1 (B > 1 raises ValueError); no attention windows.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from .conventions import Conventions
from .peer import ActiveStep, import_peer

__all__ = ["CONVENTIONS", "UNAVAILABLE", "VERSION", "cp_blockdiag_sdpa", "make_cp_blockdiag_batch_and_ctx"]

def _load():
    from nemo_automodel.components.distributed import blockdiag_cp
    from nemo_automodel.components.distributed.blockdiag_cp import batch

    return blockdiag_cp, batch


_loaded, VERSION, UNAVAILABLE = import_peer(_load, "nemo-automodel")  # unavailable: reported as skipped
_nemo, _nemo_batch = _loaded or (None, None)

CONVENTIONS = Conventions(
    document="id",
    padding="free",
    mask4d="validity",
    batch_rows="1 (B > 1 raises ValueError)",
    cp1="no-op batch function; per-document attention through the cp1 packed-varlen hooks",
    layouts="contiguous shards, S padded to a multiple of 2 x CP",
    windows="none (window_size is swallowed by **kwargs, so the adapter offers none)",
    notes=("on CPU both paths run NeMo's dense masked SDPA fallback (flash/TE varlen need CUDA)",),
)


class _Attention(nn.Module):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool, scale: float | None) -> Tensor:
        # looked up at call time: NeMo's pre-hook has swapped it for its packed varlen SDPA
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)


class _OneLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attention()


_cp1_model: _OneLayer | None = None
_cp1_active = ActiveStep()


def _cp1_layer() -> _OneLayer:
    global _cp1_model
    if _cp1_model is None:
        _cp1_model = _OneLayer()
        _nemo.attach_cp1_packed_varlen_hooks(_cp1_model)
    return _cp1_model


def make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch: dict[str, Any], loss_mask: Tensor | None = None,
                                    padding_token_id: int = 0):
    """NeMo's batch function; returns ``(train_ctx, batch)`` with ``batch["padding_mask"]`` at every CP size."""
    if _nemo is None:
        raise ImportError(UNAVAILABLE)
    if cp_mesh.size() > 1:
        train_ctx, batch, _layout = _nemo.make_cp_blockdiag_batch_and_ctx(
            cp_mesh, tp_mesh, batch, loss_mask=loss_mask, padding_token_id=padding_token_id)
        return train_ctx, batch
    primary = batch.get("inputs_embeds", batch.get("input_ids"))
    B, S = primary.shape[:2]
    doc_ids = _nemo_batch._cp_blockdiag_doc_ids(batch, S, primary.device, B)  # NeMo's own resolution
    batch.pop("attention_mask", None)
    batch["padding_mask"] = doc_ids.eq(0)
    backend = _nemo.cp1_packed_varlen_backend() or "flash"

    active = _cp1_active.train_ctx(on=True)

    @contextlib.contextmanager
    def train_ctx():
        _cp1_layer()
        _nemo.enable_cp1_packed_varlen(doc_ids, backend)
        try:
            with active():
                yield
        finally:
            _nemo.disable_cp1_packed_varlen()

    return train_ctx, batch


def cp_blockdiag_sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False) -> Tensor:
    """NeMo's ``cp_blockdiag_sdpa`` (CP > 1) or its cp1 hooked attention (CP 1)."""
    if _nemo is None:
        raise ImportError(UNAVAILABLE)
    if _cp1_active:
        return _cp1_layer().self_attn(query, key, value, enable_gqa, scale)
    return _nemo.cp_blockdiag_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                   is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
