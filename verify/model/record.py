"""Every module's output (and first input), in the order modules finish, to find the first wrong one.

A bug anywhere makes every earlier parameter's gradient wrong, so gradients cannot say where it is; outputs can.
:class:`ModuleRecorder` hooks every module of a model and, while :meth:`ModuleRecorder.forward` is active,
keeps each call's first tensor output and first tensor input, keyed ``(module name, call index)``, as
``[B, L, ...]`` views (a module's tensor is taken as sequence-aligned when its first two dims are the batch's
``[B, L]``, or its first dim ``B * L``: flattened tokens, e.g. a router's logits; a multiple of it is ambiguous,
token-major or not, and is not kept). Tensors
not aligned with the sequence (a convolution's ``[B, C, L + W - 1]``, a vision tower's patches) are not kept,
nor any call of a module that was not aligned in one of its calls of the forward, and a key is compared only where
every forward called the module equally often. Alignment comes from a call's structure, not only from its length:
every call made inside a *routed* call (a module given flattened tokens ``[N, D]`` and an integer tensor of
per-token indices ``[N, k]``: transformers' experts, ``(hidden_states, top_k_index, top_k_weights)``) runs on
the tokens routed to one expert, in routing order, and is never aligned, even when an expert receives exactly
``B * L`` tokens (every expert hit by every token, padding rows included); the routed call's own output (the
experts' sum, scattered back to the tokens) is.

:func:`packed` lays the per-document records of the reference out at the packed batch's positions;
:func:`rows_of` takes a CP rank's real rows at their global positions. Both give ``{key: [N, ...]}`` over the
same real positions, so the parent compares them row for row.

Shape legend: B rows, L rows of this rank (or a document's length), S packed length, N real positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["Key", "ModuleRecorder", "Records", "module_name", "packed", "routed", "rows_of", "seq_view"]

Key = tuple[str, int]  # (module name, index of the call in one forward); a call with scalar arguments (Gemma 3's
# rotary embedding per layer type) has them in the name, "model.rotary_emb[sliding_attention]": the order of such
# calls may follow a set's iteration order, which differs between processes


def module_name(key_name: str) -> str:
    """The module's qualified name of a key's name (without its call's scalar arguments)."""
    return key_name.split("[", 1)[0]


def _scalars(args: tuple, kwargs: dict) -> str:
    items = [repr(a) if not isinstance(a, str) else a for a in args if isinstance(a, (str, int, float, bool))]
    items += [f"{k}={v}" for k, v in sorted(kwargs.items()) if isinstance(v, (str, int, float, bool))]
    return ",".join(items)


def _first_tensor(obj) -> Tensor | None:
    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, dict) or hasattr(obj, "values") and hasattr(obj, "keys"):
        for v in obj.values():
            if isinstance(v, Tensor):
                return v
        return None
    if isinstance(obj, (tuple, list)):
        for v in obj:
            if isinstance(v, Tensor):
                return v
    return None


def routed(args: tuple, kwargs: dict) -> bool:
    """Whether a call takes flattened tokens ``[N, D]`` with per-token integer indices ``[N, k]`` (routing: the
    calls it makes run on the tokens routed to each expert, in routing order)."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
    tokens = next((t for t in tensors if t.is_floating_point()), None)
    if tokens is None or tokens.dim() != 2:
        return False
    return any(t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool and t.shape[0] == tokens.shape[0]
               for t in tensors)


def seq_view(t: Tensor | None, B: int, L: int) -> Tensor | None:
    """``t`` as ``[B, L, ...]`` when it is aligned with the rows (see the module docstring), else None."""
    if t is None or not t.is_floating_point() or t.dim() == 0:
        return None
    if t.dim() >= 2 and t.shape[0] == B and t.shape[1] == L:
        return t
    if t.shape[0] == B * L:
        return t.reshape(B, L, *t.shape[1:])
    # a first dim k * B * L (k > 1) is ambiguous: token-major [B * L, k] or k-major [k, B * L] (Llama 4's routed
    # inputs repeat the tokens once per expert); its rows cannot be named, so it is not kept
    return None


@dataclass
class Records:
    """One forward's records: ``order`` (keys in the order modules finished), ``out`` and ``inp`` ([B, L, ...]
    detached float64 copies, where aligned) and each module's class."""

    order: list[Key] = field(default_factory=list)
    out: dict[Key, Tensor] = field(default_factory=dict)
    inp: dict[Key, Tensor] = field(default_factory=dict)
    cls: dict[str, str] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # calls per key name in the forward

    def drop(self, names: set[str]) -> None:
        """Forget every call of these key names (a module whose calls depend on the data, e.g. an expert's
        activation over the tokens routed to it, cannot be matched call for call)."""
        for d in (self.out, self.inp):
            for key in [k for k in d if k[0] in names]:
                del d[key]


class ModuleRecorder:
    """Hooks on every module of ``model`` (removed by :meth:`close`); records only inside :meth:`forward`."""

    def __init__(self, model: nn.Module, skip: Callable[[str], bool] | None = None) -> None:
        """``skip(name)``: modules not hooked (e.g. a vision tower, whose patches are not rows)."""
        self.model = model
        self._active: tuple[Records, int, int] | None = None
        self._calls: dict[str, int] = {}
        self._unaligned: set[str] = set()
        self._routing: list[str] = []  # the routed calls under way (see the module docstring), innermost last
        self._handles = []
        for name, module in model.named_modules():
            if module is model or (skip is not None and skip(name)):
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))

    def _pre_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._active is not None and routed(args, kwargs):
                self._routing.append(name)

        return hook

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            if self._active is None:
                return
            rec, B, L = self._active
            scalars = _scalars(args, kwargs)
            call = f"{name}[{scalars}]" if scalars else name
            k = self._calls.get(call, 0)
            self._calls[call] = k + 1
            key = (call, k)
            rec.order.append(key)
            rec.calls[call] = k + 1
            rec.cls[name] = type(module).__name__
            if self._routing and self._routing[-1] == name:
                self._routing.pop()  # this routed call itself: its output is the tokens' (scattered back)
            elif self._routing:  # inside a routed call: on the tokens routed to one expert, whatever their count
                self._unaligned.add(call)
                return
            raw = _first_tensor(output)
            out = seq_view(raw, B, L)
            if out is not None:
                rec.out[key] = out.detach().to(torch.float64).clone()
            elif raw is not None and raw.is_floating_point() and raw.dim() >= 1:
                self._unaligned.add(call)
            first = _first_tensor(args) if args else None
            if first is None:
                first = kwargs.get("hidden_states") if isinstance(kwargs.get("hidden_states"), Tensor) else _first_tensor(kwargs)
            inp = seq_view(first, B, L)
            if inp is not None:
                rec.inp[key] = inp.detach().to(torch.float64).clone()

        return hook

    @contextlib.contextmanager
    def forward(self, B: int, L: int) -> Iterator[Records]:
        """Record the module calls of one forward over ``[B, L]`` rows."""
        rec = Records()
        self._active, self._calls, self._unaligned, self._routing = (rec, B, L), {}, set(), []
        try:
            yield rec
        finally:
            self._active = None
            rec.drop(self._unaligned)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> ModuleRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def packed(per_doc: list[Records], places: list[tuple[int, int]], lengths: list[int], real: tuple[np.ndarray, np.ndarray],
           which: str = "out") -> dict[Key, np.ndarray]:
    """The per-document records laid out at the packed positions ``real`` (arrays of rows and positions, the N
    real positions in order): ``{key: [N, ...]}``. ``places[i] = (row, start)`` of document i. A key missing
    from a document, or whose trailing shape differs between documents, is left out."""
    rows, pos = real
    out: dict[Key, np.ndarray] = {}
    keys = per_doc[0].order if per_doc else []
    for key in keys:
        parts = [getattr(r, which).get(key) for r in per_doc]
        if any(p is None for p in parts) or len({tuple(p.shape[2:]) for p in parts}) != 1:
            continue
        if len({r.calls.get(key[0]) for r in per_doc}) != 1:  # called a different number of times per document
            continue
        full = {}
        for (b, start), n, p in zip(places, lengths, parts):
            for t in range(n):
                full[(b, start + t)] = p[0, t]
        try:
            out[key] = torch.stack([full[(int(b), int(s))] for b, s in zip(rows, pos)]).numpy()
        except KeyError:
            continue
    return out


def rows_of(rec: Records, positions: Tensor, real_local: Tensor, which: str = "out") -> dict[Key, np.ndarray]:
    """This rank's records at its real rows: ``positions [B, L]`` global positions, ``real_local [B, L]`` True
    where the row is a real token -> ``{key: [n, ...]}`` in row-major order of ``real_local``."""
    out = {}
    for key, t in getattr(rec, which).items():
        if tuple(t.shape[:2]) == tuple(real_local.shape):
            out[key] = t[real_local].numpy()
    return out
