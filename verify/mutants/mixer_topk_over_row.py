"""Planted bug `mixer_topk_over_row` (see ``verify.mutants``): blockdiag_dist with one mistake in its DeepSeek
Sparse Attention: the indexer's top-k over the row's earlier tokens instead of the query's document."""

from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx  # noqa: F401

from ._mixers import mixer_module

globals().update(mixer_module("topk_over_row"))  # every family's function (causal_conv, gated_delta_rule, ssd, ...)
