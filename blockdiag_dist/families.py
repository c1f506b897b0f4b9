"""The mixer families: one entry per sequence mixer of hybrid models that blockdiag computes per document.

Main entry: :data:`FAMILIES` (name -> :class:`MixerFamily`), read by the guard (which transformers classes are
known and installed, and how: :mod:`blockdiag_dist.guard`), by the package (the distributed function, the
installer) and by the verifier (the float64 reference, ``--layer``; its block, inputs and planted bugs live in
``verify.families``, keyed by the same layer name, so that this package never imports the verifier).

An entry names its parts by import path (``"module:attribute"``), resolved when first used: the guard reads the
table at import without importing a kernel or transformers, and a family defined outside this package is an entry
like the others (:func:`register_family`)::

    >>> from blockdiag_dist.families import FAMILIES
    >>> fam = FAMILIES["gated_delta_net"]
    >>> fam.kind, fam.layer, fam.function_name
    ('gated_delta_net', 'gated_delta', 'gated_delta_rule')
    >>> fam.load("function").__name__, fam.load("reference").__name__
    ('gated_delta_rule', 'reference_gated_delta_rule')

Adding a family (docs/hybrid.md, "Adding a mixer family"): its kernels and distributed function (usually a
:class:`~blockdiag_dist.mixers.recurrence.Recurrence`), its reference in :mod:`blockdiag_ref.recurrence`, an
installer for the transformers classes, one entry here, and one ``verify.families`` spec.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FAMILIES", "MixerFamily", "family_of_class", "family_of_layer", "known_classes", "register_family"]


@dataclass(frozen=True)
class MixerFamily:
    """One sequence-mixer family.

    - ``name``: the family's name (the key of :data:`FAMILIES`);
    - ``kind``: the guard's kind of its layers (a key of :data:`blockdiag_dist.guard.MIXER_KINDS`: the words a
      refusal uses);
    - ``function``: the distributed function, ``"module:name"`` or the function (its name is also the attribute
      the verifier reads on an implementation module: ``function_name``);
    - ``reference``: the float64 token-by-token reference (in :mod:`blockdiag_ref` for the package's families);
    - ``classes``: the (transformers) classes it computes per document, through ``installer``: a callable
      ``install(cls) -> how``, or its ``"module:name"``, that the guard runs the first time a step meets the class;
    - ``refused``: classes of the same kind it does not compute (other projections, other shapes): recognised and
      refused by the guard naming the layer;
    - ``layer``: the verifier's ``--layer`` judging the function (None: not judged by the verifier);
    - ``summary``: what crosses ranks per continuing document (for the docs and the notes).
    """

    name: str
    kind: str
    function: str | Callable
    reference: str | Callable
    classes: tuple[str, ...] = ()
    installer: str | Callable | None = None
    refused: tuple[str, ...] = ()
    layer: str | None = None
    summary: str = ""

    def __post_init__(self) -> None:
        for what in ("function", "reference") + (("installer",) if self.installer is not None else ()):
            path = getattr(self, what)
            if not callable(path) and not (isinstance(path, str) and path.count(":") == 1):
                raise ValueError(f"MixerFamily {self.name!r}: {what} expected 'module:attribute' or a callable, got {path!r}")
        if self.classes and self.installer is None:
            raise ValueError(f"MixerFamily {self.name!r}: expected an installer for its classes {self.classes}, got none")
        both = set(self.classes) & set(self.refused)
        if both:
            raise ValueError(f"MixerFamily {self.name!r}: expected each class installed or refused, got both for {sorted(both)}")

    @property
    def function_name(self) -> str:
        return self.function.split(":")[1] if isinstance(self.function, str) else self.function.__name__

    def load(self, what: str) -> Callable:
        """The object ``what`` (``"function"``, ``"reference"`` or ``"installer"``) names, imported."""
        if what not in ("function", "reference", "installer"):
            raise ValueError(f"MixerFamily.load: expected 'function', 'reference' or 'installer', got {what!r}")
        path = getattr(self, what)
        if path is None:
            raise ValueError(f"MixerFamily {self.name!r}: expected an {what}, got none")
        if callable(path):
            return path
        module, attr = path.split(":")
        return getattr(importlib.import_module(module), attr)


_HF = "blockdiag_dist.integrations.hf_mixers"

FAMILIES: dict[str, MixerFamily] = {}


def register_family(family: MixerFamily) -> None:
    """Add ``family`` to :data:`FAMILIES` (and its classes to the guard's known mixers); a name registered again
    replaces its entry. ``ValueError`` when its layer or a class is another family's, or its kind is not one of
    the guard's."""
    if not isinstance(family, MixerFamily):
        raise ValueError(f"register_family: expected a MixerFamily, got {type(family).__name__}")
    for other in FAMILIES.values():
        if other.name == family.name:
            continue
        if family.layer is not None and other.layer == family.layer:
            raise ValueError(f"register_family: expected a new verifier layer, got {family.layer!r} (family {other.name!r})")
        taken = (set(other.classes) | set(other.refused)) & (set(family.classes) | set(family.refused))
        if taken:
            raise ValueError(f"register_family: expected classes of no other family, got {sorted(taken)} (family {other.name!r})")
    import sys

    guard = sys.modules.get("blockdiag_dist.guard")  # once the guard is built, it learns the classes here (before,
    if guard is not None and hasattr(guard, "KNOWN_MIXERS"):  # it reads the table itself)
        if family.kind not in guard.MIXER_KINDS:
            raise ValueError(f"register_family: expected a kind of {sorted(guard.MIXER_KINDS)}, got {family.kind!r}")
        guard.KNOWN_MIXERS.update({c: family.kind for c in family.classes + family.refused})
    FAMILIES[family.name] = family


def known_classes() -> dict[str, str]:
    """Class name -> guard kind, for every class of every family (installed or refused)."""
    return {c: f.kind for f in FAMILIES.values() for c in f.classes + f.refused}


def family_of_class(class_name: str) -> MixerFamily | None:
    """The family that installs on ``class_name``, or None (a refused class has none)."""
    return next((f for f in FAMILIES.values() if class_name in f.classes), None)


def family_of_layer(layer: str) -> MixerFamily:
    """The family the verifier's ``--layer layer`` judges; ``ValueError`` naming the layers when none."""
    for f in FAMILIES.values():
        if f.layer == layer:
            return f
    raise ValueError(f"family_of_layer: expected one of {[f.layer for f in FAMILIES.values() if f.layer]}, got {layer!r}")


for _family in (
    MixerFamily(
        name="short_conv", kind="short_conv", layer="conv",
        function="blockdiag_dist.mixers:causal_conv", reference="blockdiag_ref:reference_causal_conv",
        classes=("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"), installer=f"{_HF}:install_short_conv",
        refused=("InklingShortConvolution", "Inkling2ShortConvolution", "Inkling2DynamicShortConvolution",
                 "Inkling2LoopShortConvolution", "Inkling2LoopDynamicShortConvolution", "ZayaCCAProjection"),
        summary="the W - 1 previous tokens of the same document (history), from one or more previous ranks",
    ),
    MixerFamily(
        name="gated_delta_net", kind="gated_delta_net", layer="gated_delta",
        function="blockdiag_dist.mixers:gated_delta_rule", reference="blockdiag_ref:reference_gated_delta_rule",
        classes=("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "LaraMiniGatedDeltaNet",
                 "OlmoHybridGatedDeltaNet"),
        installer=f"{_HF}:install_gated_delta_net",
        refused=("Qwen4ExpTextGatedDeltaNet",),
        summary="(M [Hv, K, K], C [Hv, K, V]) per continuing piece (C only for a document's first piece)",
    ),
    MixerFamily(
        name="mamba2", kind="mamba2", layer="mamba2",
        function="blockdiag_dist.mixers:ssd", reference="blockdiag_ref:reference_ssd",
        classes=("Mamba2Mixer", "BambaMixer", "FalconH1Mixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer",
                 "Zamba2MambaMixer"),
        installer=f"{_HF}:install_mamba2",
        summary="(M [H], C [H, Dh, N]) per continuing piece (C only for a document's first piece)",
    ),
    MixerFamily(
        name="kda", kind="delta_attention", layer="kda",
        function="blockdiag_dist.mixers:kimi_delta_attention", reference="blockdiag_ref:reference_kda",
        classes=("KimiLinearDeltaAttention", "BailingHybridDeltaAttention"), installer=f"{_HF}:install_kda",
        summary="(M [H, K, K], C [H, K, V]) per continuing piece (C only for a document's first piece)",
    ),
    MixerFamily(
        name="dsa", kind="sparse_attention", layer="sparse",
        function="blockdiag_dist.sparse:dsa_attention", reference="blockdiag_ref:reference_dsa_attention",
        classes=("DeepseekV32Attention", "GlmMoeDsaAttention", "AXK2Attention", "HYV4Attention", "HYV4VLAttention",
                 "MistralLarge4TextAttention"),
        installer="blockdiag_dist.integrations.hf_sparse:install_dsa",
        summary="the latent and indexer key of each earlier token of the same document held elsewhere (the "
                "attention's needed-only exchange, no summary)",
    ),
    MixerFamily(
        name="compressed", kind="compressed_attention", layer=None,
        function="blockdiag_dist.compressed:compressed_attention",
        reference="blockdiag_ref:reference_compressed_attention",
        classes=("DeepseekV4Attention",),
        installer="blockdiag_dist.integrations.hf_compressed:install_compressed",
        summary="the projections (sliding key, compressor and indexer inputs) of each earlier token of the same "
                "document held elsewhere (the attention's needed-only exchange, no summary)",
    ),
    MixerFamily(
        name="mamba1", kind="mamba", layer="mamba1",
        function="blockdiag_dist.mixers:selective_scan", reference="blockdiag_ref:reference_selective_scan",
        classes=("MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"),
        installer=f"{_HF}:install_mamba1",
        summary="(M [I, N], C [I, N]) per continuing piece (C only for a document's first piece)",
    ),
    MixerFamily(
        name="lightning", kind="lightning_attention", layer="lightning",
        function="blockdiag_dist.mixers:lightning_attention", reference="blockdiag_ref:reference_lightning_attention",
        classes=("MiniMaxLightningAttention",), installer=f"{_HF}:install_lightning",
        summary="(M [H], C [H, V, K]) per continuing piece (C only for a document's first piece; M = exp(-slope n) "
                "from the piece's length)",
    ),
):
    register_family(_family)
