"""``ring-flash-attn``'s llama3 varlen API (``llama3_flash_attn_varlen_func``) behind the seed's API.

CUDA only: the package imports ``flash_attn`` (a CUDA build) at import time, so it is not installed by
``make peers`` on a CPU machine and this adapter reports itself unavailable there, with the reason.

On CUDA (``pip install ring-flash-attn==0.1.8`` with flash-attn present): one packed row (B = 1) is
flattened into the varlen token stream; ``cu_seqlens`` are the maximal runs of the full doc ids (padding runs
are segments of their own, so padding rows are not zeroed); ``llama3_flash_attn_prepare_cu_seqlens`` gives
each rank its local ``cu_seqlens`` and key slice, as the package's README shows; contiguous shards of
S / CP tokens (S must divide); fp16 / bf16 (flash-attn's dtypes).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor

from .conventions import Conventions, Unsupported
from .peer import ActiveStep, import_peer, start_batch

__all__ = ["CONVENTIONS", "UNAVAILABLE", "VERSION", "cp_blockdiag_sdpa", "make_cp_blockdiag_batch_and_ctx"]

PACKAGE = "ring-flash-attn"
_rfa, VERSION, UNAVAILABLE = import_peer(
    lambda: importlib.import_module("ring_flash_attn"), PACKAGE,
    missing=f"CUDA only: {PACKAGE} imports flash_attn, a CUDA build, at import time; not installed here",
)
if UNAVAILABLE is None and not torch.cuda.is_available():
    UNAVAILABLE = "CUDA only: flash-attn kernels, no CUDA device here"

CONVENTIONS = Conventions(
    document="run",
    padding="free",
    mask4d="documents",
    batch_rows="1 (one varlen token stream)",
    cp1="a ring of one rank",
    dtypes=("bfloat16", "float16"),
    devices=("cuda",),
    layouts="contiguous shards, S a multiple of CP",
    windows="none in this adapter",
)

_active = ActiveStep()


def make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch: dict[str, Any], loss_mask: Tensor | None = None,
                                    padding_token_id: int = 0):
    """Contiguous shards and this rank's varlen metadata."""
    if UNAVAILABLE:
        raise Unsupported(UNAVAILABLE)
    world, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    primary = batch.get("inputs_embeds", batch.get("input_ids"))
    B, S = primary.shape[:2]
    if B != 1 or S % world:
        raise Unsupported(f"ring-flash-attn varlen: expected B = 1 and S a multiple of CP {world}, got B={B}, S={S}")
    _, B, S, ids = start_batch(batch, loss_mask)
    starts = torch.nonzero(torch.nn.functional.pad(ids[0, 1:] != ids[0, :-1], (1, 0), value=True)).flatten()
    cu = torch.cat([starts, torch.tensor([S], device=starts.device)]).to(torch.int32)
    cu_q, cu_k, max_q, max_k, k_slice = _rfa.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)
    L = S // world
    for key in ("inputs_embeds", "input_ids", "labels", "position_ids", "_packed_seq_ids", "loss_mask", "padding_mask"):
        t = batch.get(key)
        if isinstance(t, Tensor) and t.dim() >= 2:
            batch[key] = t[:, rank * L:(rank + 1) * L]
    meta = {"cu_q": cu_q, "cu_k": cu_k, "max_q": max_q, "max_k": max_k, "k_slice": k_slice,
            "group": cp_mesh.get_group()}
    return _active.train_ctx(**meta), batch


def cp_blockdiag_sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False) -> Tensor:
    """``[1, H, L, D]`` in and out through ``llama3_flash_attn_varlen_func``."""
    if UNAVAILABLE:
        raise Unsupported(UNAVAILABLE)
    m = _active
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [L, H, D]
    out = _rfa.llama3_flash_attn_varlen_func(
        q, k, v, m["cu_q"], m["cu_k"], m["max_q"], m["max_k"], heads_k_stride=1, local_k_slice=m["k_slice"],
        dropout_p=dropout_p, softmax_scale=scale, causal=True, group=m["group"])
    return out.transpose(0, 1)[None]
