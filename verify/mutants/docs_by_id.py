"""Planted convention `docs_by_id` (see ``verify.mutants``): every token sharing an id is one document, and the
module declares it, like a third-party adapter does."""

from verify.adapters import Conventions

from ._toy import make_toy

CONVENTIONS = Conventions(document="id")
make_cp_blockdiag_batch_and_ctx, cp_blockdiag_sdpa = make_toy("docs_by_id")
