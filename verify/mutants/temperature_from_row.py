"""Planted bug `temperature_from_row` (see ``verify.mutants``)."""

from ._toy import make_toy

make_cp_blockdiag_batch_and_ctx, cp_blockdiag_sdpa = make_toy("temperature_from_row")
