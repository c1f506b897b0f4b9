"""Adapters: third-party CP attention behind the seed's two functions, with their conventions declared.

An adapter is a small module exposing ``make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch, ...)`` ->
``(train_ctx, batch)`` and ``cp_blockdiag_sdpa(q, k, v, ...)``, like any ``--impl`` module, plus:

- ``CONVENTIONS``: a :class:`Conventions` saying where the implementation's contract differs from ours
  (what a document is, whether padding rows are zeroed, how a 4-D mask is read, batch rows, dtypes, devices,
  the doc-id sources it reads: the verifier's matrix covers exactly those);
  the verifier re-checks a failing case under them before calling it a bug;
- ``VERSION``: the third party's version string (``None`` when it is not installed);
- ``UNAVAILABLE``: ``None``, or why it cannot run here (package missing, CUDA only): ``--impl`` then stops
  with that reason, and the conformance report lists the adapter as skipped.

``--impl`` takes an adapter's short name (``--impl nemo``) or any module path. Every adapter also offers
:func:`verify.adapters.attention_step` (forward + backward of one attention call on a sharded batch) for
use outside the verifier, e.g. in benchmarks.
"""

from __future__ import annotations

from .conventions import OURS, Conventions, Unsupported, attention_step

__all__ = ["ADAPTERS", "OURS", "Conventions", "Unsupported", "attention_step", "module_path"]

ADAPTERS: dict[str, str] = {
    "blockdiag_dist": "blockdiag_dist",
    "nemo": "verify.adapters.nemo",
    "ring_attention": "verify.adapters.ring_attention",
    "torch_cp": "verify.adapters.torch_cp",
    "ring_flash_attn": "verify.adapters.ring_flash_attn",
    "ringmaster": "verify.adapters.ringmaster",
    "ringmaster_ulysses": "verify.adapters.ringmaster_ulysses",
}


def module_path(name: str) -> str:
    """The module behind ``--impl name``: an adapter's short name or a module path given as is."""
    return ADAPTERS.get(name, name)
