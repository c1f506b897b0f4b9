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

__all__ = ["BackendRecorder"]

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


class _Mode(TorchFunctionMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA:
            self.counts[f"{_backend_name(args, kwargs)}/{args[0].dtype}".replace("torch.", "")] += 1
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
    """

    def __init__(self) -> None:
        self._counts: dict[str, Counter] = {}

    @contextlib.contextmanager
    def role(self, name: str) -> Iterator[None]:
        with _Mode(self._counts.setdefault(name, Counter())):
            yield

    def counts(self) -> dict[str, dict[str, int]]:
        return {role: dict(sorted(c.items())) for role, c in self._counts.items()}
