"""Planted bug `block_cut_at_rank_edge` (see ``verify.mutants``)."""

from ._toy import make_toy

make_cp_blockdiag_batch_and_ctx, cp_blockdiag_sdpa = make_toy("block_cut_at_rank_edge")
