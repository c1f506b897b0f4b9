"""Option names, their synonyms, and process-wide defaults (``configure_cp_varlen``)."""

from __future__ import annotations

import threading

__all__ = [
    "EXCHANGES",
    "KERNELS",
    "LAYOUTS",
    "configure_cp_varlen",
    "get_defaults",
    "resolve_exchange",
    "resolve_kernel",
    "resolve_layout",
]

# canonical name -> accepted spellings (compared case-insensitively, '-' read as '_')
EXCHANGES: dict[str, tuple[str, ...]] = {
    "auto": ("auto",),
    "allgather": ("allgather", "all_gather"),
    "halo": ("halo", "needed_only"),
    "a2a": ("a2a", "all_to_all", "alltoall"),
}
KERNELS: dict[str, tuple[str, ...]] = {
    "auto": ("auto",),
    "varlen": ("varlen", "flash", "flash_attention_2", "fa2", "flash_attn", "te", "transformer_engine"),
    "dense": ("dense", "sdpa"),
}
LAYOUTS: dict[str, tuple[str, ...]] = {
    "contiguous": ("contiguous", "sequential"),
    "balanced": ("balanced", "load_balanced"),
    "auto": ("auto",),
}

# Synonyms that name a backend blockdiag does not ship: the substitution is recorded in the step state.
KERNEL_SUBSTITUTES: dict[str, str] = {
    "te": "TransformerEngine is not used: blockdiag's varlen kernel computes the same per-document attention",
    "transformer_engine": "TransformerEngine is not used: blockdiag's varlen kernel computes the same per-document attention",
}

_lock = threading.Lock()
_defaults = {"kv_exchange": "auto", "kernel": "auto"}


def _resolve(what: str, value: object, table: dict[str, tuple[str, ...]]) -> str:
    if isinstance(value, str):
        key = value.strip().lower().replace("-", "_")
        for canonical, spellings in table.items():
            if key in spellings:
                return canonical
    valid = ", ".join(repr(s) for spellings in table.values() for s in spellings)
    raise ValueError(f"{what}: expected one of {valid} (case-insensitive), got {value!r}")


def resolve_exchange(value: object) -> str:
    """Canonical K/V exchange name: 'auto' | 'allgather' | 'halo' | 'a2a'."""
    return _resolve("kv_exchange", value, EXCHANGES)


def resolve_kernel(value: object, what: str = "kernel") -> str:
    """Canonical kernel name: 'auto' | 'varlen' | 'dense'."""
    return _resolve(what, value, KERNELS)


def resolve_layout(value: object) -> str:
    """Canonical sharding layout name."""
    return _resolve("layout", value, LAYOUTS)


def kernel_substitution(value: object) -> str | None:
    """Why a kernel synonym runs another backend than its name says (None when it does not)."""
    if isinstance(value, str):
        return KERNEL_SUBSTITUTES.get(value.strip().lower().replace("-", "_"))
    return None


def configure_cp_varlen(*, attn_backend: str | None = None, kv_exchange: str | None = None) -> dict[str, str]:
    """Set process-wide defaults for :func:`make_cp_blockdiag_batch_and_ctx`; returns the defaults now in force.

    Names are case-insensitive and accept the common synonyms: ``flash`` / ``flash_attention_2`` / ``fa2`` /
    ``te`` / ``transformer_engine`` (-> ``varlen``), ``dense`` / ``sdpa``; ``allgather`` / ``all_gather``,
    ``halo`` / ``needed_only``, ``a2a`` / ``all_to_all``. Keyword options given to the batch function win.

    >>> configure_cp_varlen(attn_backend="FA2", kv_exchange="all-gather")
    {'kv_exchange': 'allgather', 'kernel': 'varlen', 'kernel_requested': 'FA2'}
    >>> configure_cp_varlen(attn_backend="auto", kv_exchange="auto")["kv_exchange"]
    'auto'
    """
    updates: dict[str, str] = {}
    if attn_backend is not None:
        updates["kernel"] = resolve_kernel(attn_backend, "attn_backend")
        updates["kernel_requested"] = attn_backend
    if kv_exchange is not None:
        updates["kv_exchange"] = resolve_exchange(kv_exchange)
    with _lock:
        _defaults.update(updates)
        return dict(_defaults)


def get_defaults() -> dict[str, str]:
    with _lock:
        return dict(_defaults)
