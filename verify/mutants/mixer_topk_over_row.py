"""Planted bug `mixer_topk_over_row` (see ``verify.mutants``): blockdiag_dist with one mistake in its DeepSeek
Sparse Attention: the indexer's top-k over the row's earlier tokens instead of the query's document."""

from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx  # noqa: F401

from ._mixers import dsa_topk_over_row as dsa_attention  # noqa: F401
