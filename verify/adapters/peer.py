"""What the adapters share: importing the third party (its version, or why it cannot run here), the values a
step keeps while its ``train_ctx`` is entered, and the common start of a batch function.

Shape legend: ``B`` rows, ``S`` positions per row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any, ContextManager, TypeVar

from torch import Tensor

__all__ = ["ActiveStep", "import_peer", "start_batch"]

T = TypeVar("T")


def import_peer(load: Callable[[], T], package: str, *, version: Callable[[], str] | None = None,
                missing: str | None = None) -> tuple[T | None, str | None, str | None]:
    """``(load(), VERSION, UNAVAILABLE)``: what ``load`` imports, the version (``package``'s installed version by
    default) and ``None``; or ``(None, None, why)`` when the import fails (``missing``, default "``package`` is
    not installed (make peers)", then the ImportError)."""
    try:
        loaded = load()
    except ImportError as exc:
        return None, None, f"{missing or f'{package} is not installed (make peers)'}: {exc}"
    return loaded, (version() if version is not None else metadata.version(package)), None


class ActiveStep(dict):
    """The values of the step whose ``train_ctx`` is entered (empty outside one). A plain module-level mapping,
    not a ``ContextVar``: autograd's threads, where checkpoint recomputes run, must see it too."""

    def train_ctx(self, **values: Any) -> Callable[[], ContextManager]:
        """A ``train_ctx`` that holds ``values`` while entered."""

        @contextlib.contextmanager
        def train_ctx() -> Iterator[None]:
            self.update(values)
            try:
                yield
            finally:
                self.clear()

        return train_ctx


def start_batch(batch: dict[str, Any], loss_mask: Tensor | None) -> tuple[Tensor, int, int, Tensor]:
    """The start every adapter's batch function shares: ``(primary stream, B, S, doc ids [B, S])``, with
    ``attention_mask`` dropped, ``loss_mask`` stored and ``padding_mask`` (True = pad) added to ``batch``. The doc
    ids come from our resolution (``blockdiag_ref.doc_ids_from_batch``): they tell the verifier which rows are
    padding; what the third party reads is its own business."""
    from blockdiag_ref import doc_ids_from_batch

    primary = batch.get("inputs_embeds", batch.get("input_ids"))
    B, S = primary.shape[:2]
    ids = doc_ids_from_batch(batch, S, B, primary.device)
    batch.pop("attention_mask", None)
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    batch["padding_mask"] = ids == 0
    return primary, B, S, ids
