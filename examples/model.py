"""A tiny decoder-only transformer whose attention routes through ``cp_blockdiag_sdpa``.

Token embedding, RoPE driven by ``position_ids`` (so per-document positions survive CP sharding), GQA
attention, SwiGLU MLP, RMSNorm, untied LM head. Optional activation checkpointing per block.

Shape legend: B batch rows, L positions (this rank's shard under CP), H hidden size, Hq / Hkv heads,
D head dim, V vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from blockdiag_dist import cp_blockdiag_sdpa

__all__ = ["CHECKPOINTING", "TinyConfig", "TinyDecoder"]

CHECKPOINTING = (None, "reentrant", "non_reentrant")


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 64
    hidden: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    mlp_hidden: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(position_ids_BL: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` ``[B, 1, L, D / 2]`` for the given positions."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=dtype, device=position_ids_BL.device) / head_dim)
    angles = position_ids_BL.to(dtype)[:, None, :, None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x_BHLD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x_BHLD.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x_BLH: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, L, _ = x_BLH.shape
        q_BHLD = self.q_proj(x_BLH).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k_BHLD = self.k_proj(x_BLH).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        v_BHLD = self.v_proj(x_BLH).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        q_BHLD, k_BHLD = apply_rope(q_BHLD, cos, sin), apply_rope(k_BHLD, cos, sin)
        # inside train_ctx(): per-document causal attention across CP ranks; outside: stock causal SDPA
        o_BHLD = cp_blockdiag_sdpa(q_BHLD, k_BHLD, v_BHLD, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(o_BHLD.transpose(1, 2).reshape(B, L, -1))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.gate = nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.hidden, bias=False)

    def forward(self, x_BLH: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x_BLH = x_BLH + self.attn(self.attn_norm(x_BLH), cos, sin)
        h = self.mlp_norm(x_BLH)
        return x_BLH + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyDecoder(nn.Module):
    """``forward(input_ids [B, L], position_ids [B, L]) -> logits [B, L, V]``.

    ``checkpointing``: ``None``, ``"reentrant"`` or ``"non_reentrant"`` (``torch.utils.checkpoint`` per block;
    the recompute in backward runs under the step its forward used, found in the autograd graph).
    """

    def __init__(self, cfg: TinyConfig, checkpointing: str | None = None) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads or cfg.head_dim % 2:
            raise ValueError(
                f"TinyConfig: expected hidden % heads == 0, heads % kv_heads == 0 and an even head dim, got "
                f"hidden={cfg.hidden}, heads={cfg.heads}, kv_heads={cfg.kv_heads}"
            )
        if checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing: expected one of {CHECKPOINTING}, got {checkpointing!r}")
        self.cfg = cfg
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        x_BLH = self.embed(input_ids)
        cos, sin = rope_tables(position_ids, self.cfg.head_dim, self.cfg.rope_theta, x_BLH.dtype)
        for block in self.blocks:
            if self.checkpointing is None:
                x_BLH = block(x_BLH, cos, sin)
            else:
                x_BLH = checkpoint(block, x_BLH, cos, sin, use_reentrant=self.checkpointing == "reentrant")
        return self.lm_head(self.norm(x_BLH))
