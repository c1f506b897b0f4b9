"""axolotl-ringmaster's Ulysses attention (``axolotl-ringmaster==0.2.7``) behind the seed's API: the adapter of
:mod:`verify.adapters.ringmaster` with ``RingmasterConfig(backend="ulysses")`` (see its docstring for what it
calls and the conventions, taken from ringmaster's code)."""

from __future__ import annotations

from .ringmaster import ULYSSES_CONVENTIONS as CONVENTIONS
from .ringmaster import UNAVAILABLE, VERSION, RingmasterAdapter

__all__ = ["CONVENTIONS", "UNAVAILABLE", "VERSION", "cp_blockdiag_sdpa", "make_cp_blockdiag_batch_and_ctx"]

_ulysses = RingmasterAdapter("ulysses")
make_cp_blockdiag_batch_and_ctx = _ulysses.make_cp_blockdiag_batch_and_ctx
cp_blockdiag_sdpa = _ulysses.cp_blockdiag_sdpa
