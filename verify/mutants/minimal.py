"""Every planted bug behind an adapter that declares minimal support: one kernel and one exchange (its batch
function takes no ``kernel``, ``kv_exchange`` or ``layout`` keyword), documents from ``_packed_seq_ids`` only,
our conventions otherwise. The verifier's matrix must find each bug through it as well (``--quick`` included):
a narrow declaration must not leave a (layout, value) pair unmet.

    python -m verify --impl verify.mutants.minimal.docs_by_id --quick     (fails: ids reused later in a row leak)
    python -m verify --impl verify.mutants.minimal.toy --quick            (passes)

``verify.mutants.minimal.<name>`` exists for ``toy``, every bug of ``verify.mutants._toy.BUGS`` and every mixer
bug (``mixer_state_leak`` ...): the modules are made here, when this one is imported (an import of
``verify.mutants.minimal.off_by_one`` imports this module first, then finds the submodule it registered).

The adapter declares our conventions whatever the module it wraps declares: ``docs_by_id``'s documents by id
equality become an undeclared difference, a bug (the id-equality leak of an implementation that never says so).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from typing import Any

from verify.adapters import Conventions, Unsupported

from ._mixers import MIXER_BUGS, mixer_functions
from ._toy import BUGS

__all__ = ["CONVENTIONS", "NAMES", "minimal_adapter"]

CONVENTIONS = Conventions(sources=("packed",), notes=("minimal support: one kernel, one exchange, _packed_seq_ids only",))
NAMES = ("toy", *BUGS, *(f"mixer_{bug}" for bug in MIXER_BUGS))


def minimal_adapter(inner_name: str, name: str) -> types.ModuleType:
    """A module ``name`` exposing ``inner_name``'s seed functions (and mixers) behind the minimal declaration."""
    inner = importlib.import_module(inner_name)
    module = types.ModuleType(name, f"``{inner_name}`` behind the minimal adapter (see verify.mutants.minimal).")
    # a step of mixers alone (no attention call) is announced to blockdiag_dist-based modules, as the verifier does
    params = inspect.signature(inner.make_cp_blockdiag_batch_and_ctx).parameters
    announce = "expect_attention" in params

    def make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch: dict[str, Any], loss_mask=None, padding_token_id=0, *,
                                        expect_attention: bool = True, bidirectional_blocks=None):
        if batch.get("_packed_seq_ids") is None or batch.get("attention_mask") is not None:
            given = sorted(k for k in ("_packed_seq_ids", "attention_mask") if batch.get(k) is not None)
            raise Unsupported(f"minimal adapter: expected documents as _packed_seq_ids and no attention_mask, got "
                              f"{', '.join(given) or 'neither'}")
        extra = {"expect_attention": expect_attention} if announce else {}
        if bidirectional_blocks is not None:  # the variant is declared where the module takes it (stripped below)
            extra["bidirectional_blocks"] = bidirectional_blocks
        return inner.make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch, loss_mask, padding_token_id, **extra)

    if "bidirectional_blocks" not in params:  # the signature declares the variant only where the module takes it
        def make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch, loss_mask=None, padding_token_id=0, *,
                                            expect_attention: bool = True, _full=make_cp_blockdiag_batch_and_ctx):
            return _full(cp_mesh, tp_mesh, batch, loss_mask, padding_token_id, expect_attention=expect_attention)
    module.make_cp_blockdiag_batch_and_ctx = make_cp_blockdiag_batch_and_ctx
    module.cp_blockdiag_sdpa = inner.cp_blockdiag_sdpa  # its signature says which windows and variants it takes
    for fn in mixer_functions():
        if callable(getattr(inner, fn, None)):
            setattr(module, fn, getattr(inner, fn))
    module.CONVENTIONS = CONVENTIONS
    return module


for _name in NAMES:
    _full = f"{__name__}.{_name}"
    if _full not in sys.modules:
        sys.modules[_full] = minimal_adapter(f"verify.mutants.{_name}", _full)
