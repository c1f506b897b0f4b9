"""blockdiag_dist.integrations — what a trainer needs around the batch function.

Main entries: :class:`PackingCollator` / :func:`pack_documents` pack documents into rows with pre-shifted
labels, ``_packed_seq_ids`` and per-document ``position_ids``; :func:`causal_lm_loss`,
:func:`global_token_count` and :func:`all_reduce_grads` make a DP x CP step's loss and gradients exact;
:func:`register_transformers_attention` plugs CP into Hugging Face transformers models (needs the ``hf``
extra; nothing here imports transformers until it is called).
"""

from .hf import ATTENTION_NAME, blockdiag_attention_forward, register_transformers_attention
from .packing import IGNORE_INDEX, PackingCollator, pack_documents
from .training import all_reduce_grads, all_reduce_sum_, causal_lm_loss, global_token_count, mesh_groups

__all__ = [
    "ATTENTION_NAME",
    "IGNORE_INDEX",
    "PackingCollator",
    "all_reduce_grads",
    "all_reduce_sum_",
    "blockdiag_attention_forward",
    "causal_lm_loss",
    "global_token_count",
    "mesh_groups",
    "pack_documents",
    "register_transformers_attention",
]
