"""Never silent on a layer CP does not compute per document.

Under CP every layer that mixes information along the sequence must see documents, not rows. blockdiag_dist
computes softmax attention per document (:func:`~blockdiag_dist.cp_blockdiag_sdpa`) and the mixers declared
with :func:`declare_per_document`; any other layer that mixes along the sequence would run across document ends
and start a document continuing from another rank from zero state: trained, silently wrong. While a step
context is active, this guard refuses such a layer on every rank, before it computes:

- **at the first call of a module in the step**, its whole subtree is scanned (the model's root, usually: one
  scan per step). Refused: a module whose class, or a base class, is a known sequence mixer of the pinned
  transformers (:data:`KNOWN_MIXERS`: Mamba, Mamba2, short convolutions, Gated DeltaNet, delta, lightning and
  linear attention, RG-LRU, xLSTM, RWKV), or any module holding a state-space / gated-decay parameter
  (:data:`RECURRENT_PARAMETERS`: ``A_log``, ``dt_bias``);
- **at the call of a sequence operator**: an ``nn.Conv1d`` of kernel > 1 or an ``nn.RNN`` / ``LSTM`` / ``GRU``
  whose input runs along this rank's ``L`` rows (a length within the convolution's padding of ``L``).

The rule does not see a mixer written with plain tensor ops (a ``cumsum`` scan, ``F.conv1d`` called directly,
a custom kernel) in a class it does not know; ``check_model`` lists what it finds, before training.
Every ``UnsupportedLayerError`` names the layer, its class, what it is, and what would make it work.

Shape legend: B batch rows, L rows held by this rank.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import families as _families

__all__ = [
    "KNOWN_MIXERS",
    "MIXER_KINDS",
    "Finding",
    "UnsupportedLayerError",
    "check_model",
    "declare_per_document",
    "per_document_reason",
]


class UnsupportedLayerError(RuntimeError):
    """A layer that mixes along the sequence, not computed per document under CP, was called in a CP step."""


# kind -> what the layer computes along the sequence (in the refusal's words)
MIXER_KINDS: dict[str, str] = {
    "mamba": "a Mamba selective-scan state-space mixer (a recurrent state and a causal convolution)",
    "mamba2": "a Mamba2 (SSD) state-space mixer (a recurrent state and a causal convolution)",
    "short_conv": "a short causal convolution along the sequence",
    "gated_delta_net": "a Gated DeltaNet linear-attention mixer (a recurrent state and a causal convolution)",
    "delta_attention": "a delta-rule linear-attention mixer (a recurrent state and a causal convolution)",
    "linear_attention": "a linear-attention mixer (a recurrent state)",
    "lightning_attention": "a lightning (linear) attention mixer (a recurrent state)",
    "rglru": "an RG-LRU recurrent block (a recurrent state and a causal convolution)",
    "xlstm": "an xLSTM (mLSTM) recurrent layer (a recurrent state)",
    "rwkv": "an RWKV time-mixing layer (a recurrent state and a token shift)",
    "token_shift": "a token shift (each token mixes in the previous one)",
    "alibi_attention": "softmax attention with an ALiBi bias that the layer computes itself, not through "
                       "transformers' attention interface or scaled_dot_product_attention, so blockdiag cannot route it",
    "own_attention": "softmax attention the layer computes itself (a softmax in its own code, no call of "
                     "scaled_dot_product_attention or transformers' attention interface), so blockdiag cannot route it",
    "sparse_attention": "sparse attention over keys an indexer selects from the sequence",
    "compressed_attention": "attention over compressed blocks of the sequence (a compressor or indexer over "
                            "neighbouring tokens)",
    "row_positions": "a positional embedding computed from the row's length (torch.arange over the rows), not from "
                     "position_ids: wrong for every document but the row's first once packed, and on every rank "
                     "but the first under CP",
    "byte_patching": "byte patching with n-gram hash embeddings over neighbouring tokens",
    "recurrent": "a layer holding a state-space / gated-decay parameter (a recurrence along the sequence)",
    "conv1d": "a Conv1d along the sequence",
    "rnn": "a recurrent network (nn.RNN / LSTM / GRU) along the sequence",
}

# Class name -> kind: the sequence mixers of the pinned transformers (5.24) besides softmax attention. A class
# matches by its own name or any base class's, so subclasses and same-named copies are refused too. The classes of
# the mixer families (blockdiag_dist.families: installed, or of a family's kind and refused) come from their
# entries; the others are listed here.
KNOWN_MIXERS: dict[str, str] = {
    # linear attention (MiniMax's lightning attention is the lightning family's)
    "Glm5NextTextLinearAttention": "linear_attention",
    # RG-LRU, xLSTM, RWKV
    "RecurrentGemmaRglru": "rglru", "RecurrentGemmaRecurrentBlock": "rglru",
    "xLSTMLayer": "xlstm", "xLSTMBackend": "xlstm",
    "RwkvSelfAttention": "rwkv", "RwkvFeedForward": "token_shift",
    # attention computed by the layer itself, with ALiBi (Falcon's rotary variant is refused at build time by
    # register_transformers_attention, its attention does not call the interface either)
    "BloomAttention": "alibi_attention", "MptAttention": "alibi_attention", "FalconAttention": "alibi_attention",
    # attention over compressed blocks (DeepSeek-V4: its attention layers are computed per document, the compressed
    # family of blockdiag_dist.families installs them; their compressors and indexers inside are then theirs; one
    # met in any other layer is refused), byte patching (BLT)
    "DeepseekV4HCACompressor": "compressed_attention", "DeepseekV4CSACompressor": "compressed_attention",
    "DeepseekV4Indexer": "compressed_attention",
    # sparse attention over indexer-selected keys (DeepSeek-V3.2 DSA and its descendants). The attention layers of
    # DeepSeek-V3.2, GLM-5, A.X-K2, HY-V4 (and HY-V4-VL) and Mistral Large 4 are computed per document (the dsa
    # family of blockdiag_dist.families installs them: their indexers inside are then theirs); an indexer met in
    # any other layer is refused
    "DeepseekV32Indexer": "sparse_attention", "AXK2Indexer": "sparse_attention", "Dots3NoteTextIndexer": "sparse_attention",
    "Glm5NextTextIndexer": "sparse_attention", "GlmMoeDsaIndexer": "sparse_attention", "HYV4Indexer": "sparse_attention",
    "HYV4VLIndexer": "sparse_attention", "MiniMaxM3VLIndexer": "sparse_attention",
    "MistralLarge4TextIndexer": "sparse_attention", "Qwen4ExpTextQSAIndexer": "sparse_attention",
    "BltPatcher": "byte_patching", "BltModel": "byte_patching",
    # decoders that compute their positions from the row's length, whatever position_ids say
    "BartDecoder": "row_positions", "BigBirdPegasusDecoder": "row_positions", "BlenderbotDecoder": "row_positions",
    "BlenderbotSmallDecoder": "row_positions", "MarianDecoder": "row_positions", "MBartDecoder": "row_positions",
    "PegasusDecoder": "row_positions", "PLBartDecoder": "row_positions", "MvpDecoder": "row_positions",
    "PPFormulaNetTextModel": "row_positions", "ProphetNetDecoder": "row_positions", "CpmAntModel": "row_positions",
}
KNOWN_MIXERS.update(_families.known_classes())
assert {f.kind for f in _families.FAMILIES.values()} <= set(MIXER_KINDS), "a mixer family of an unknown kind"

# Parameters that only a recurrence along the sequence holds (Mamba's A_log / dt_bias, Gated DeltaNet's A_log).
RECURRENT_PARAMETERS = ("A_log", "dt_bias")


@dataclass(frozen=True)
class Finding:
    """One layer the rule refuses (or, with ``per_document`` set, one it lets through as computed per document)."""

    name: str  # qualified module name in the scanned tree ("" for the root)
    cls: str  # the module's class name
    kind: str  # a key of MIXER_KINDS
    reason: str  # how it was recognised
    per_document: str | None = None  # how it is computed per document, when it is

    def message(self) -> str:
        where = f"layer {self.name!r} ({self.cls})" if self.name else f"layer {self.cls}"
        return (
            f"blockdiag_dist: {where} is not computed per document under CP: it is {MIXER_KINDS[self.kind]} "
            f"({self.reason}). Expected every layer that mixes along the sequence to be computed per document; this "
            "one would mix tokens across document ends and miss the part of its document held by other ranks: its "
            "gradients would be silently wrong. Computed per document: softmax attention through cp_blockdiag_sdpa "
            f"(sdpa_routing(), register_transformers_attention()) and the mixers {_supported_summary()}; a layer "
            "your own code computes per document (from the step's documents, current_state().docs) is declared with "
            "declare_per_document(module, how). Refused on every rank, before the layer ran."
        )


class _Registry:
    """Classes and modules declared as computed per document (the installers of known classes are the mixer
    families', :mod:`blockdiag_dist.families`)."""

    def __init__(self) -> None:
        self.classes: dict[type, str] = {}
        self.modules: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()


_registry = _Registry()


def declare_per_document(target: type | nn.Module, how: str) -> None:
    """Declare that ``target`` (a module class or one module) computes per document under a CP step, so that the
    guard lets it run: ``how`` says how (shown by :func:`check_model` and in notes). Declare only a layer that
    keeps documents apart and carries the state of a document continuing from another rank (e.g. from the
    step's ``docs``), or one that does not mix along the sequence at all."""
    if not isinstance(how, str) or not how:
        raise ValueError(f"declare_per_document: expected a non-empty description 'how', got {how!r}")
    if isinstance(target, type) and issubclass(target, nn.Module):
        _registry.classes[target] = how
    elif isinstance(target, nn.Module):
        _registry.modules[target] = how
    else:
        raise ValueError(f"declare_per_document: expected an nn.Module class or instance, got {type(target).__name__}")


_visitors: list[Callable[[nn.Module], None]] = []


def register_scan_visitor(visit: Callable[[nn.Module], None]) -> None:
    """Call ``visit(module)`` for every module a step's scan meets (once per module and step, before the module
    and its children run: the scan starts at the first module called in the step). Used by the integrations to
    prepare a model for the step (e.g. a hook at a vision-language model's decoder entry). Idempotent."""
    if visit not in _visitors:
        _visitors.append(visit)


def per_document_reason(module: nn.Module) -> str | None:
    """How ``module`` is computed per document (declared, or installed for its class), or None."""
    how = _registry.modules.get(module)
    if how is not None:
        return how
    for cls in type(module).__mro__:
        how = _registry.classes.get(cls)
        if how is not None:
            return how
    return None


def _supported_summary() -> str:
    names = sorted(c for f in _families.FAMILIES.values() for c in f.classes)
    return "of " + ", ".join(names) if names else "declared per document (none of transformers' yet)"


def _known_kind(cls: type) -> tuple[str, str] | None:
    for base in cls.__mro__:
        kind = KNOWN_MIXERS.get(base.__name__)
        if kind is not None:
            via = "" if base is cls else f", a subclass of {base.__name__}"
            return kind, f"recognised by its class{via}"
    return None


def _install(cls: type) -> str | None:
    """Install the per-document implementation of the mixer family of ``cls`` (or a base), once; its ``how``, or
    None."""
    for base in cls.__mro__:
        family = _families.family_of_class(base.__name__)
        if family is not None:
            with _registry.lock:
                how = _registry.classes.get(base)
                if how is None:
                    how = family.load("installer")(base)
                    _registry.classes[base] = how
            return how


_POSITIONAL = re.compile(r"Positional(Embedding|Encoding)s?$")
_ROUTED = ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "scaled_dot_product_attention", "cp_blockdiag_sdpa")


@functools.lru_cache(maxsize=None)
def _positions_from_rows(cls: type) -> bool:
    """A positional embedding class whose forward cannot take ``position_ids`` (it derives positions from the
    input's shape)."""
    if not _POSITIONAL.search(cls.__name__):
        return False
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
    return "position_ids" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values())


@functools.lru_cache(maxsize=None)
def _computes_own_attention(cls: type) -> bool:
    """An ``*Attention*`` class whose own source has a softmax and calls neither SDPA, transformers' attention
    interface nor cp_blockdiag_sdpa (judged at its call, by the shape of its input)."""
    if "Attention" not in cls.__name__ or cls.__module__.startswith("torch."):
        return False
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return "softmax" in source and not any(name in source for name in _ROUTED)


def classify(module: nn.Module) -> Finding | None:
    """What the scan rule says of one module (not its children): None if it does not recognise a sequence
    mixer; a :class:`Finding` otherwise, with ``per_document`` set when it is computed per document."""
    cls = type(module)
    known = _known_kind(cls)
    if known is not None:
        kind, reason = known
    else:
        params = [n for n in RECURRENT_PARAMETERS if n in module._parameters]
        if params:
            kind, reason = "recurrent", f"it holds the parameter {params[0]!r}"
        elif _positions_from_rows(cls):
            kind, reason = "row_positions", "its forward takes no position_ids"
        else:
            return None
    how = per_document_reason(module) or (_install(cls) if known is not None else None)
    return Finding(name="", cls=cls.__name__, kind=kind, reason=reason, per_document=how)


def _walk(root: nn.Module, seen: dict[int, bool] | None = None):
    """``(name, module, finding, inside)`` for ``root``'s tree in module order, not descending into a module
    computed per document (its children are its own: ``inside`` is True for them) nor into one in ``seen``."""
    stack = [("", root, False)]
    while stack:
        name, module, inside = stack.pop()
        if seen is not None and id(module) in seen:
            continue
        finding = None if inside else classify(module)
        yield name, module, finding, inside
        inside = inside or (finding is not None and finding.per_document is not None)
        children = [(f"{name}.{n}" if name else n, m, inside) for n, m in module._modules.items() if m is not None]
        stack.extend(reversed(children))


def check_model(model: nn.Module) -> list[Finding]:
    """Every layer of ``model`` the scan rule recognises as a sequence mixer, in module order, each with how
    it is computed per document or ``per_document=None`` (refused under a CP step). Does not descend into a
    module computed per document. Sequence operators (``nn.Conv1d``, RNNs) are judged at their call, by the
    shape of their input, and are not listed here."""
    return [
        Finding(name=name, cls=f.cls, kind=f.kind, reason=f.reason, per_document=f.per_document)
        for name, _, f, _ in _walk(model)
        if f is not None
    ]


# ---- the step's guard -------------------------------------------------------------------------------------
class StepGuard:
    """Per step: which modules were scanned, and the root each scan started from (to name layers)."""

    def __init__(self, local_len: int, notes: Callable[[str], None]) -> None:
        self.local_len = local_len
        self.note = notes
        self.verdicts: dict[int, bool] = {}  # id(module) -> True: checked, inside a per-document mixer
        self.names: dict[int, str] = {}  # id(module) -> its name in the tree its scan started from
        self._modules: list[nn.Module] = []  # keeps the ids above valid for the step
        self.per_document: list[str] = []  # classes of the known mixers computed per document this step

    def before_call(self, module: nn.Module, args: tuple) -> None:
        inside = self.verdicts.get(id(module))
        if inside is None:
            self._scan(module)
            inside = self.verdicts[id(module)]
        if not inside:
            self._check_operator(module, args)

    def _scan(self, root: nn.Module) -> None:
        for name, module, f, inside in _walk(root, self.verdicts):
            for visit in _visitors:
                visit(module)
            if f is not None and f.per_document is None:
                raise UnsupportedLayerError(Finding(name, f.cls, f.kind, f.reason).message())
            if f is not None:
                self.note(f"{f.cls}: computed per document ({f.per_document})")
                if f.cls not in self.per_document:
                    self.per_document.append(f.cls)
            self.verdicts[id(module)] = inside or f is not None
            self.names[id(module)] = name
            self._modules.append(module)

    def after_call(self, module: nn.Module, output: object) -> None:
        """An attention that computes itself is judged by its output (its inputs may be keywords, which a global
        pre-hook does not see): along this rank's rows, it is refused before any backward ran."""
        if self.verdicts.get(id(module), True) or not _computes_own_attention(type(module)):
            return
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if torch.is_tensor(out) and out.dim() >= 2 and out.shape[-2] == self.local_len:
            raise UnsupportedLayerError(
                Finding(self.names.get(id(module), ""), type(module).__name__, "own_attention",
                        f"its output {tuple(out.shape)} runs along this rank's L = {self.local_len} rows").message()
            )

    def _check_operator(self, module: nn.Module, args: tuple) -> None:
        L = self.local_len
        if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1 and args and torch.is_tensor(args[0]):
            length = args[0].shape[-1]
            reach = (module.kernel_size[0] - 1) * module.dilation[0]
            if L <= length <= L + 2 * reach:
                raise UnsupportedLayerError(
                    Finding(self.names.get(id(module), ""), type(module).__name__, "conv1d",
                            f"kernel {module.kernel_size[0]} over an input of length {length}, this rank's "
                            f"L = {L} rows").message()
                )
        elif isinstance(module, nn.RNNBase) and args and torch.is_tensor(args[0]) and args[0].dim() >= 2:
            x = args[0]
            length = x.shape[1] if (module.batch_first and x.dim() == 3) else x.shape[0]
            if length == L:
                raise UnsupportedLayerError(
                    Finding(self.names.get(id(module), ""), type(module).__name__, "rnn",
                            f"an input of length {length} = this rank's L rows").message()
                )


_hook_lock = threading.Lock()
_hook_users = 0
_get_guard: Callable[[], StepGuard | None] = lambda: None


def _before(module: nn.Module, args: tuple) -> None:
    if torch.compiler.is_compiling():  # the eager call of an enclosing module scanned it
        return None
    guard = _get_guard()
    if guard is not None:
        guard.before_call(module, args)
    return None


def _after(module: nn.Module, args: tuple, output: object) -> None:
    if torch.compiler.is_compiling():
        return None
    guard = _get_guard()
    if guard is not None:
        guard.after_call(module, output)
    return None


# (registry of global hooks, register function, hook, its handle once registered). The same functions under the
# same handle ids every time, so that code compiled by torch.compile (which guards on the global hooks) is not
# recompiled for every step.
_HOOKS = [
    [nn.modules.module._global_forward_pre_hooks, nn.modules.module.register_module_forward_pre_hook, _before, None],
    [nn.modules.module._global_forward_hooks, nn.modules.module.register_module_forward_hook, _after, None],
]


def install(get_guard: Callable[[], StepGuard | None]) -> None:
    """Install the process-wide forward hooks (once for any number of active steps)."""
    global _hook_users, _get_guard
    with _hook_lock:
        _hook_users += 1
        _get_guard = get_guard
        for entry in _HOOKS:
            hooks, register, hook, handle = entry
            if handle is None:
                entry[3] = register(hook)
            elif handle.id not in hooks:
                hooks[handle.id] = hook


def uninstall() -> None:
    global _hook_users
    with _hook_lock:
        _hook_users -= 1
        if _hook_users == 0:
            for _, _, _, handle in _HOOKS:
                if handle is not None:
                    handle.remove()
