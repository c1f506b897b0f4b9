"""blockdiag_dist.integrations — what a trainer needs around the batch function.

Main entries: :class:`PackingCollator` / :func:`pack_documents` pack documents into rows with pre-shifted
labels, ``_packed_seq_ids`` and per-document ``position_ids``; :func:`causal_lm_loss`,
:func:`global_token_count` and :func:`all_reduce_grads` make a DP x CP step's loss and gradients exact (under
DDP or FSDP2: :func:`flat_mesh` with :func:`allreduce_sum_hook` or :func:`fsdp_sum_gradients`);
:func:`register_transformers_attention` plugs CP into Hugging Face transformers models (needs the ``hf``
extra; nothing here imports transformers until it is called), vision-language models included
(:mod:`~blockdiag_dist.integrations.vlm`; :func:`pack_multimodal_documents` packs (text, images) documents with
per-document mRoPE positions).
"""

from .hf import ATTENTION_NAME, blockdiag_attention_forward, register_transformers_attention
from .multimodal import MultimodalPackingCollator, model_inputs, mrope_position_ids, pack_multimodal_documents
from .packing import IGNORE_INDEX, PackingCollator, pack_documents, shift_labels
from .training import (
    all_reduce_grads,
    all_reduce_sum_,
    allreduce_sum_hook,
    causal_lm_loss,
    flat_mesh,
    fsdp_sum_gradients,
    global_token_count,
    mesh_groups,
)

__all__ = [
    "ATTENTION_NAME",
    "IGNORE_INDEX",
    "MultimodalPackingCollator",
    "PackingCollator",
    "all_reduce_grads",
    "all_reduce_sum_",
    "allreduce_sum_hook",
    "blockdiag_attention_forward",
    "causal_lm_loss",
    "flat_mesh",
    "fsdp_sum_gradients",
    "global_token_count",
    "mesh_groups",
    "model_inputs",
    "mrope_position_ids",
    "pack_documents",
    "pack_multimodal_documents",
    "register_transformers_attention",
    "shift_labels",
]
