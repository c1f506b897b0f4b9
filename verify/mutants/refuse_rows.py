"""Planted limit `refuse_rows` (see ``verify.mutants``): B > 1 refused with a ValueError on every rank."""

from ._toy import make_toy

make_cp_blockdiag_batch_and_ctx, cp_blockdiag_sdpa = make_toy("refuse_rows")
