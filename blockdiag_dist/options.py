"""Option names, their synonyms, process-wide defaults (``configure_cp_varlen``), and :class:`CPOptions`: the
one validated object holding the batch function's keyword options, shared by the batch function, the trainer
integration and config files."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CPOptions",
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


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class CPOptions:
    """The keyword options of :func:`~blockdiag_dist.make_cp_blockdiag_batch_and_ctx`, validated once: frozen,
    every field checked at construction (``ValueError`` naming expected vs got), names canonicalised
    (``"FA2"`` -> ``"varlen"``). ``None`` for ``kv_exchange`` / ``kernel`` means the process-wide default of
    :func:`configure_cp_varlen`, read when the batch function runs. The field docs are the batch function's.

    >>> opts = CPOptions(kernel="FA2", layout="load-balanced", window_sizes=[(4, 0), None])
    >>> opts.kernel, opts.layout, opts.window_sizes
    ('varlen', 'balanced', ((4, 0), None))
    >>> CPOptions.from_mapping({"layout": "auto", "conv_widths": [4]}).conv_widths
    (4,)
    >>> CPOptions(layout="zigzag")
    Traceback (most recent call last):
    ...
    ValueError: layout: expected one of 'contiguous', 'sequential', 'balanced', 'load_balanced', 'auto' (case-insensitive), got 'zigzag'
    """

    kv_exchange: str | None = None
    kernel: str | None = None
    layout: str = "contiguous"
    window_sizes: tuple[tuple[int, int] | None, ...] | None = None
    check_consensus: bool | None = None
    expect_attention: bool = True
    shard_primary: bool = True
    shard_vision: bool = False
    conv_widths: tuple[int, ...] | None = None
    padding_token_id: int = 0
    # the kernel name as the user spelled it (a synonym may name a backend blockdiag substitutes: recorded)
    kernel_requested: str | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen: set once, here
        if self.kv_exchange is not None:
            put("kv_exchange", resolve_exchange(self.kv_exchange))
        if self.kernel is not None:
            if self.kernel_requested is None:
                put("kernel_requested", self.kernel)
            put("kernel", resolve_kernel(self.kernel))
        put("layout", resolve_layout(self.layout))
        if self.window_sizes is not None:
            from blockdiag_ref import normalize_window

            ws = self.window_sizes
            if isinstance(ws, (str, bytes)) or not isinstance(ws, Sequence):
                raise ValueError(f"window_sizes: expected None or a sequence of window_size pairs or None, got {ws!r}")
            for w in ws:
                normalize_window(w)
            put("window_sizes", tuple(None if w is None else (int(w[0]), int(w[1])) for w in ws))
        if self.check_consensus is not None:
            _bool("check_consensus", self.check_consensus)
        for name in ("expect_attention", "shard_primary", "shard_vision"):
            _bool(name, getattr(self, name))
        if self.shard_vision and self.shard_primary:
            raise ValueError(
                "shard_vision=True: expected shard_primary=False (the model's own forward runs its vision tower under "
                "the step), got shard_primary=True"
            )
        cw = self.conv_widths
        if cw is not None:
            if (isinstance(cw, (str, bytes)) or not isinstance(cw, Sequence) or not cw
                    or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in cw)):
                raise ValueError(f"conv_widths: expected None or a non-empty sequence of convolution widths >= 1, got {cw!r}")
            put("conv_widths", tuple(cw))
        if not isinstance(self.padding_token_id, int) or isinstance(self.padding_token_id, bool):
            raise ValueError(f"padding_token_id: expected an int, got {type(self.padding_token_id).__name__}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> CPOptions:
        """From a config's mapping (a YAML section, ``TrainingArguments``-style fields); an unknown key is refused."""
        if not isinstance(values, Mapping):
            raise ValueError(f"CPOptions: expected a mapping of option names to values, got {type(values).__name__}")
        known = [f.name for f in dataclasses.fields(cls) if f.name != "kernel_requested"]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"CPOptions: expected keys among {known}, got unknown {unknown}")
        return cls(**values)

    def replace(self, **changes: Any) -> CPOptions:
        """A copy with ``changes`` applied, validated like a new object."""
        if "kernel" in changes:
            changes.setdefault("kernel_requested", None)
        return dataclasses.replace(self, **changes)

    def resolved_exchange(self) -> str:
        """The K/V exchange in force: this object's, else the process-wide default."""
        return self.kv_exchange if self.kv_exchange is not None else resolve_exchange(get_defaults()["kv_exchange"])

    def resolved_kernel(self) -> tuple[str, object]:
        """(canonical kernel, the name as requested) in force: this object's, else the process-wide default."""
        if self.kernel is not None:
            return self.kernel, self.kernel_requested
        defaults = get_defaults()
        requested = defaults.get("kernel_requested", defaults["kernel"])
        return resolve_kernel(requested), requested
