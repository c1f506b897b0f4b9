"""The module recorder of ``verify model`` (verify/model/record.py): which calls it takes as aligned with the rows.

An expert's activation runs on the tokens routed to that expert, in routing order (slot-major: the tokens for which
the expert is the first choice, then the second); with as many experts as choices every expert receives every
token, B * L of them, and a length test alone would take that call as aligned with the rows (Mistral Large 4's
tiny preset, CP 1, padding-rank: its activation compared row for row in shuffled order, a false "bug").
"""

from __future__ import annotations

import torch
from torch import nn

from verify.model.record import ModuleRecorder, routed


class Experts(nn.Module):
    """transformers' eager experts in miniature: ``(hidden_states [N, D], top_k_index [N, k], top_k_weights [N, k])``."""

    def __init__(self, experts: int = 2, dim: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, dim, dim, generator=torch.Generator().manual_seed(0)))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        mask = nn.functional.one_hot(top_k_index, self.weight.shape[0]).permute(2, 1, 0)  # [E, k, N]
        for e in range(self.weight.shape[0]):
            slot, token = torch.where(mask[e])
            h = self.act_fn(hidden_states[token] @ self.weight[e])
            out.index_add_(0, token, h * top_k_weights[token, slot, None])
        return out


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.experts = Experts()

    def forward(self, x):  # x [B, L, D]
        h = x.reshape(-1, x.shape[-1])
        w, idx = self.router(h).softmax(-1).topk(2, dim=-1)  # two choices of two experts: every expert, every token
        return self.experts(h, idx, w).reshape(x.shape)


def test_calls_inside_routed_experts_are_never_aligned_by_their_count():
    model = nn.Sequential(MoE())
    B, L = 2, 5
    x = torch.randn(B, L, 4, generator=torch.Generator().manual_seed(1))
    with ModuleRecorder(model) as recorder, recorder.forward(B, L) as rec:
        model(x)
    names = {k[0] for k in rec.out}
    assert "0.experts.act_fn" not in names  # B * L tokens per expert, in routing order: not the rows
    assert {"0.experts", "0.router", "0"} <= names  # the experts' sum is scattered back to the tokens: aligned
    assert rec.calls["0.experts.act_fn"] == 2
    assert rec.out[("0.experts", 0)].shape == (B, L, 4)


def test_routed_takes_flattened_tokens_with_per_token_indices():
    h, idx = torch.randn(6, 4), torch.zeros(6, 2, dtype=torch.int64)
    assert routed((h, idx, torch.rand(6, 2)), {})
    assert routed((h,), {"top_k_index": idx})
    assert not routed((torch.randn(2, 3, 4),), {"position_ids": torch.zeros(2, 3, dtype=torch.int64)})  # attention
    assert not routed((h,), {"mask": torch.zeros(6, 2, dtype=torch.bool)})
    assert not routed((h,), {})
