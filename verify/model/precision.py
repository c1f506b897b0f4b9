"""What a model computes below its own dtype, named by module, and a way to compute it in float64 after all.

Models round on purpose: transformers' RMSNorms cast to float32 whatever the model's dtype, rotary embeddings
compute their angles in float32, routers take their softmax in float32, eager attention takes its softmax in
float32, the CPU paths of linear attention and state-space mixers compute in float32. In a float64 model those ops carry float32 error, so the float64 limit of 1e-10 would judge the model,
not CP. :func:`float32_ops` runs a forward under a ``TorchDispatchMode`` that records every op whose floating
output is below float64, with the innermost module it ran in. :class:`Promote` is the opposite mode: it runs
every op in float64 (lower-precision inputs upcast, ``dtype=`` arguments raised), so that the cost of those ops
can be measured (the model as written against the model in float64), and :func:`float64_eager_attention`
applies it to transformers' eager attention functions only: the reference of a model without SDPA support then
computes attention in float64, as CP does; :func:`float64_modules` does the same for chosen modules (the
sequence mixers a CP implementation replaces).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "LOW", "LowPrecisionUse", "Promote", "float32_ops", "float64_decay_tables", "float64_eager_attention", "float64_islands",
    "float64_modules",
    "module_stack",
]

LOW = (torch.float32, torch.bfloat16, torch.float16)
# ops that only view, move or copy a tensor: not worth naming (the op that produced it is named)
_PLUMBING = {
    "view", "_unsafe_view", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze", "slice", "select",
    "detach", "alias", "reshape", "clone", "contiguous", "as_strided", "split", "split_with_sizes", "unbind",
    "index_select", "cat", "stack", "copy_", "lift_fresh", "empty_like", "zeros_like", "new_empty", "_reshape_alias",
    "unflatten", "flatten", "repeat", "narrow", "chunk", "select_backward", "index", "masked_fill",
}


@dataclass
class LowPrecisionUse:
    """One module in which ops ran below float64: its name, class and the ops (``aten`` names, counted)."""

    module: str
    cls: str
    ops: Counter = field(default_factory=Counter)
    params: set[str] = field(default_factory=set)  # the model's parameters cast below float64 here (their
    # gradients are then summed below float64 by the model itself)

    def line(self) -> str:
        ops = ", ".join(op for op, _ in self.ops.most_common())
        return f"{self.module or '(model)'} ({self.cls}): {ops}"


@contextlib.contextmanager
def module_stack(model: nn.Module) -> Iterator[list[tuple[str, str]]]:
    """A list kept equal to the stack of ``model``'s modules being called (``(name, class)``, innermost last)."""
    stack: list[tuple[str, str]] = []
    handles = []
    for name, m in model.named_modules():
        def pre(mod, args, _name=name):
            stack.append((_name, type(mod).__name__))

        def post(mod, args, out, _name=name):
            while stack and stack[-1][0] != _name:
                stack.pop()
            if stack:
                stack.pop()

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


class _Record(TorchDispatchMode):
    def __init__(self, stack: list[tuple[str, str]], found: dict[str, LowPrecisionUse], params: dict[int, str]) -> None:
        super().__init__()
        self.stack = stack
        self.found = found
        self.params = params

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        flat, _ = tree_flatten(out)
        if any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype in LOW for t in flat):
            cast = [self.params[t.data_ptr()] for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.data_ptr() in self.params]
            if name not in _PLUMBING or cast:
                where, cls = self.stack[-1] if self.stack else ("", "model")
                use = self.found.setdefault(where, LowPrecisionUse(where, cls))
                use.ops[name] += 1
                use.params.update(cast)
        return out


def float32_ops(model: nn.Module, run: Callable[[], object]) -> list[LowPrecisionUse]:
    """The modules of ``model`` in which ``run()`` (a forward, no grad needed) computed below float64, in the
    order they first did, each with its ops and the parameters it cast below float64."""
    found: dict[str, LowPrecisionUse] = {}
    params = {p.data_ptr(): n for n, p in model.named_parameters()}
    with module_stack(model) as stack, torch.no_grad(), _Record(stack, found, params):
        run()
    return list(found.values())


class Promote(TorchDispatchMode):
    """Every op in float64: lower-precision floating inputs are upcast and ``dtype=`` arguments below float64
    raised to it (outputs are float64 where the code asked for float32)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def up(x):
            if isinstance(x, torch.Tensor) and x.dtype in LOW:
                return x.to(torch.float64)
            if isinstance(x, torch.dtype) and x in LOW:
                return torch.float64
            return x

        return func(*tree_map(up, args), **tree_map(up, kwargs or {}))


@contextlib.contextmanager
def float64_eager_attention(model: nn.Module) -> Iterator[list[str]]:
    """While active, the ``eager_attention_forward`` functions of ``model``'s modeling modules run under
    :class:`Promote` (yields the modules patched). transformers passes them to every attention layer at call time
    (``ALL_ATTENTION_FUNCTIONS.get_interface(..., eager_attention_forward)``), so the module global is the one
    called."""
    patched: list[tuple[object, Callable]] = []
    names = sorted({type(m).__module__ for m in model.modules()})
    for modname in names:
        mod = sys.modules.get(modname)
        fn = getattr(mod, "eager_attention_forward", None) if mod is not None else None
        if fn is None or getattr(fn, "_float64", False):
            continue

        def wrapped(*args, _fn=fn, **kwargs):
            with Promote():
                return _fn(*args, **kwargs)

        wrapped._float64 = True  # type: ignore[attr-defined]
        patched.append((mod, fn))
        mod.eager_attention_forward = wrapped  # type: ignore[attr-defined]
    try:
        yield [m.__name__ for m, _ in patched]
    finally:
        for mod, fn in patched:
            mod.eager_attention_forward = fn  # type: ignore[attr-defined]


@contextlib.contextmanager
def float64_modules(model: nn.Module, match: Callable[[nn.Module], bool]) -> Iterator[list[str]]:
    """While active, every module of ``model`` for which ``match(module)`` holds runs its forward under
    :class:`Promote` (its backward is then float64 too: autograd replays the ops it ran). Yields their names."""
    handles, names = [], []
    modes: list[Promote] = []
    for name, m in model.named_modules():
        if not match(m):
            continue
        names.append(name)

        def pre(mod, args):
            mode = Promote()
            mode.__enter__()
            modes.append(mode)

        def post(mod, args, out):
            if modes:
                modes.pop().__exit__(None, None, None)

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        yield names
    finally:
        for h in handles:
            h.remove()
        while modes:
            modes.pop().__exit__(None, None, None)


def float64_islands(model: nn.Module, classes: tuple[str, ...]):
    """The modules of ``model`` whose class is named in ``classes`` run in float64 (:func:`float64_modules`), in a
    float64 model only: in a lower dtype (or with no classes) nothing changes (a context manager either way)."""
    p = next(model.parameters(), None)
    if not classes or p is None or p.dtype != torch.float64:
        return contextlib.nullcontext([])
    return float64_modules(model, lambda m: type(m).__name__ in classes)


def float64_decay_tables(model: nn.Module) -> None:
    """MiniMax's lightning layers make their decay tables (``query_decay``, ``key_decay``, ``diagonal_decay``:
    ``exp(-slope n)``) once, at init, in float32; a model cast to float64 keeps those float32 roundings (relative
    6e-8: the model's own float32 step, not CP's). Recomputed here in float64 from the layer's slope, for the
    float64 truth (blockdiag computes the decays from the slope, in the model's dtype): ``verify model``'s models
    (:func:`verify.model.zoo.build`) and ``verify.model.hybrid``'s are built so. Other models: unchanged."""
    for m in model.modules():
        if type(m).__name__ == "MiniMaxLightningAttention" and m.slope_rate.dtype == torch.float64:
            m.query_decay, m.key_decay, m.diagonal_decay = m.decay_factors(m.slope_rate)
