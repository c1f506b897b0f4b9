"""Tiny transformers decoders whose attention has a variant blockdiag carries under CP, each with a twin on the
model's own stock attention (same weights), for parity against each document run alone:

- ``gpt-oss``: attention sinks (``s_aux``, one learned logit per head) on every layer, layer 0 a sliding
  window of 8, layer 1 full; mixture-of-experts MLPs;
- ``llama4``: as released, chunked local attention (``attention_chunk_size=8``) on layer 0 (RoPE), full attention
  on the NoPE layer 1 with temperature tuning on (``attn_temperature_tuning``, ``attn_scale=0.1``; ``floor_scale=4``
  instead of 8192, so that short documents reach it): its queries scaled by their positions inside their documents;
- ``gemma2``: logit soft-capping 2.0 on both layers (``final_logit_softcapping`` on the logits too), layer 0 a
  sliding window of 8; scores scaled by ``head_dim ** -0.5`` and initial weights of standard deviation 0.3, so
  that scores reach the cap.

Shapes: hidden 32, 2 layers, 4 query and 2 key/value heads of 8, vocabulary 64. Needs the ``hf`` extra.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from blockdiag_dist.integrations import pack_documents, register_transformers_attention

__all__ = [
    "STOCK_ATTENTION", "VARIANT_MODELS", "build_variant_models", "cp_variant_step", "cp_variant_steps", "documents",
    "variant_config",
]

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
VARIANT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (model_type, config beside SHAPE)
    "gpt-oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    "llama4": ("llama4_text", dict(intermediate_size_mlp=32, num_local_experts=2, attention_chunk_size=8,
                                   attn_temperature_tuning=True, attn_scale=0.1, floor_scale=4,
                                   no_rope_layer_interval=2)),
    # query_pre_attn_scalar = head_dim and larger initial weights: scores of a few units, which a cap of 2 bends
    # (at transformers' default init they are ~1e-3 and the cap changes nothing)
    "gemma2": ("gemma2", dict(sliding_window=8, attn_logit_softcapping=2.0, query_pre_attn_scalar=8, initializer_range=0.3)),
}
# The stock attention of each model's truth: transformers' SDPA refuses sinks and soft-capping (eager computes
# them); Llama 4's chunks are a mask SDPA takes.
STOCK_ATTENTION = {"gpt-oss": "eager", "llama4": "sdpa", "gemma2": "eager"}


def variant_config(name: str, **overrides: Any):
    """The tiny config of ``name`` (one of :data:`VARIANT_MODELS`), with ``overrides``."""
    from transformers import AutoConfig

    if name not in VARIANT_MODELS:
        raise ValueError(f"name: expected one of {sorted(VARIANT_MODELS)}, got {name!r}")
    model_type, extra = VARIANT_MODELS[name]
    return AutoConfig.for_model(model_type, **SHAPE, **{**extra, **overrides})


def build_variant_models(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float64, stock: bool = True,
                         **overrides: Any) -> tuple[nn.Module, nn.Module | None]:
    """``(model, stock)``: the model on blockdiag's attention and its twin on :data:`STOCK_ATTENTION` (None with
    ``stock=False``), same weights (drawn from ``seed``; gpt-oss' sinks from N(0, 1), so that they weigh in every
    softmax), in ``dtype``, in training mode. Experts run transformers' eager loop (its grouped matmul has no
    float64)."""
    from transformers import AutoModelForCausalLM

    config = variant_config(name, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=register_transformers_attention(),
                                             dtype=dtype, experts_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".sinks"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    if not stock:
        return model.train(), None
    twin = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=STOCK_ATTENTION[name],
                                            dtype=dtype, experts_implementation="eager")
    twin.load_state_dict(model.state_dict())
    return model.train(), twin.train()


def documents(lengths: Sequence[int], seed: int = 0, vocab: int = SHAPE["vocab_size"]) -> list[Tensor]:
    """Random token ids (never 0, the padding id) for documents of ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in lengths]


def cp_variant_step(name: str, lengths: Sequence[int], seq_len: int, *, seed: int = 0, cp_mesh: Any = None,
                    **options: Any):
    """One step of ``name`` under CP on the packed documents of ``lengths`` (one row of ``seq_len``), loss and
    gradients summed over ``cp_mesh`` (None: one rank; :func:`verify.model.harness.cp_step`; ``options`` go to the
    batch function). Every rank of ``cp_mesh`` calls it with the same arguments."""
    from verify.model.harness import cp_step

    model, _ = build_variant_models(name, seed=seed, stock=False)
    batch = pack_documents(documents(lengths, seed), seq_len=seq_len)
    return cp_step(model, batch, cp_mesh, **options)


def cp_variant_steps(runs: Sequence[tuple[str, Sequence[int], int]], cp: int):
    """In a pool (or torchrun group) of ``len(runs) * cp`` ranks: CP groups of ``cp`` consecutive ranks side by side
    (a ``("dp", "cp")`` mesh), group ``g`` running ``cp_variant_step(*runs[g])``; each rank returns its group's
    result."""
    import torch.distributed as dist

    from examples.training import _cached_mesh

    world = dist.get_world_size()
    if world != len(runs) * cp:
        raise ValueError(f"cp_variant_steps: expected a group of len(runs) * cp = {len(runs) * cp} ranks, got {world}")
    mesh = _cached_mesh(len(runs), cp, "cpu")
    name, lengths, seq_len = runs[dist.get_rank() // cp]
    return cp_variant_step(name, lengths, seq_len, cp_mesh=mesh["cp"])
