"""Which SDPA backend torch picks for each ``scaled_dot_product_attention`` call made inside a block.

A ``TorchFunctionMode`` sees every call of torch's SDPA (the implementation binds the same builtin) and asks
torch's own selector, ``torch._fused_sdp_choice``, with the call's arguments, as SDPA itself does before it
dispatches: the backend the call then runs (flash, memory-efficient, cuDNN, math, or the CPU fused kernel,
which torch names FLASH_ATTENTION on CPU). Nothing is allocated: a mask is passed on as it came. A fused
attention op called directly (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``, as the varlen
kernel does on CPU) is counted under its own name.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["BackendRecorder", "fully_masked_rows"]

_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_FUSED_OPS = {  # forward ops only: a backward runs the backend of its forward
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
}


def _backend_name(args: tuple, kwargs: dict) -> str:
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "unknown (this torch has no torch._fused_sdp_choice)"
    q, k, v, *rest = args
    opts = dict(zip(_ARGS, rest), **kwargs)
    try:
        index = choose(q, k, v, **opts)
        from torch.nn.attention import SDPBackend

        return SDPBackend(index).name
    except Exception as exc:  # noqa: BLE001 - the report says why the backend is unknown
        return f"unknown ({type(exc).__name__}: {exc})"[:200]


def fully_masked_rows(args: tuple, kwargs: dict) -> int:
    """Query rows of an SDPA call that may attend to no key: all False in a bool mask, all -inf in an additive
    one, or (``is_causal``) no key at all. CUDA's fused backends may return NaN for such a row, in the output or
    in the gradients, whatever the caller does with it afterwards."""
    q, k = args[0], args[1]
    opts = dict(zip(_ARGS, args[3:]), **kwargs)
    mask = opts.get("attn_mask")
    if k.shape[-2] == 0:
        return q.shape[-2]
    if mask is None:
        return 0
    with torch._C.DisableTorchFunction():
        empty = ~mask.any(-1) if mask.dtype == torch.bool else torch.isneginf(mask).all(-1)
        return int(empty.sum())


class _Mode(TorchFunctionMode):
    def __init__(self, counts: Counter, device: str | None = None) -> None:
        super().__init__()
        self.counts, self.device = counts, device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA:
            where = args[0].device.type
            elsewhere = f" on {where}" if self.device is not None and where != self.device else ""  # a stand-in's
            self.counts[f"{_backend_name(args, kwargs)}{elsewhere}/{args[0].dtype}".replace("torch.", "")] += 1
            empty = fully_masked_rows(args, kwargs)
            if empty:
                self.counts["fully masked rows"] += empty
        else:
            name = str(func)
            if name.startswith("aten.") and name.split(".")[1] in _FUSED_OPS:
                self.counts[f"{name.split('.')[1]} (called directly)/{args[0].dtype}".replace("torch.", "")] += 1
        return func(*args, **kwargs)


class BackendRecorder:
    """Counts SDPA calls per role and backend::

        rec = BackendRecorder()
        with rec.role("baseline"):
            ...                      # every SDPA call in here is counted under "baseline"
        rec.counts()                 # {"baseline": {"FLASH_ATTENTION/float32": 3}}

    A role's ``"fully masked rows"`` counts the query rows its SDPA calls got with no key to attend to (none
    expected: see :func:`fully_masked_rows`).
    """

    def __init__(self, device: str | None = None) -> None:
        """``device``: the run's device type; a call on another one (a baseline stood in for there,
        :data:`verify.tolerances.STAND_INS`) is counted as ``BACKEND on <device>/dtype``."""
        self._counts: dict[str, Counter] = {}
        self.device = device

    @contextlib.contextmanager
    def role(self, name: str) -> Iterator[None]:
        with _Mode(self._counts.setdefault(name, Counter()), self.device):
            yield

    def counts(self) -> dict[str, dict[str, int]]:
        return {role: dict(sorted(c.items())) for role, c in self._counts.items()}
