"""The mixer-family registry (blockdiag_dist.families) and the verifier's specs (verify.families): one entry per
family that the guard, the package and the verifier read, kept consistent; docs/hybrid.md's "Adding a mixer
family" example runs."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import mixer_checks
from blockdiag_dist import guard
from blockdiag_dist.families import FAMILIES, MixerFamily, family_of_class, family_of_layer, register_family
from blockdiag_dist.integrations import hf_compressed, hf_mixers, hf_sparse
from verify.families import SPECS
from verify.mutants._mixers import MIXER_BUGS, mixer_module

pytestmark = pytest.mark.usefixtures("one_thread")

INSTALLER_TABLES = {"gated_delta_net": hf_mixers.GATED_DELTA_NET_CLASSES, "mamba2": hf_mixers.MAMBA2_CLASSES,
                    "short_conv": hf_mixers.SHORT_CONV_CLASSES, "dsa": hf_sparse.DSA_CLASSES,
                    "mamba1": hf_mixers.MAMBA1_CLASSES, "lightning": hf_mixers.LIGHTNING_CLASSES,
                    "compressed": hf_compressed.COMPRESSED_CLASSES}


def test_every_family_resolves_and_the_guard_knows_its_classes():
    # the package's own entries; a family a user (or a docs example run in this process) registers is not judged here
    ours = [f for f in FAMILIES.values() if f.load("function").__module__.startswith("blockdiag_dist")]
    assert {f.name for f in ours} >= set(INSTALLER_TABLES)
    for fam in ours:
        assert callable(fam.load("function")) and callable(fam.load("reference"))
        assert fam.load("function").__name__ == fam.function_name
        assert fam.load("reference").__module__.startswith("blockdiag_ref")
        if fam.classes:
            assert callable(fam.load("installer"))
        for cls in fam.classes + fam.refused:
            assert guard.KNOWN_MIXERS[cls] == fam.kind, cls
        assert all(family_of_class(c) is fam for c in fam.classes)
        assert all(family_of_class(c) is None for c in fam.refused)
        assert fam.kind in guard.MIXER_KINDS
    for name, table in INSTALLER_TABLES.items():  # the installer's per-class adapters: exactly the entry's classes
        assert set(table) == set(FAMILIES[name].classes), name


def test_every_verifier_layer_is_a_family_and_every_bug_is_planted_and_reachable():
    assert {f.layer for f in FAMILIES.values() if f.layer} >= set(SPECS)
    for layer, spec in SPECS.items():
        assert family_of_layer(layer).function_name == spec.function_name
        assert spec.weight_names[-1] == "wo" and set(spec.mutants) <= set(MIXER_BUGS), layer
    planted = {b for s in SPECS.values() for b in s.mutants}
    assert planted == set(MIXER_BUGS)
    good = {s.function_name: s.family.load("function") for s in SPECS.values()}
    for bug in MIXER_BUGS:
        module = importlib.import_module(f"verify.mutants.mixer_{bug}")
        assert set(mixer_module(bug)) == set(good)
        wrong = {s.function_name for s in SPECS.values() if bug in s.mutants}
        for name, fn in good.items():  # the planted function where a family plants the bug, blockdiag_dist's elsewhere
            assert (getattr(module, name) is not fn) == (name in wrong), (bug, name)
    with pytest.raises(ValueError, match="expected a bug of"):
        mixer_module("no_such_bug")
    with pytest.raises(ValueError, match="expected one of"):
        family_of_layer("no_such_layer")


@pytest.mark.parametrize("change, match", [
    pytest.param({"function": "no_colon"}, "function expected 'module:attribute' or a callable", id="bad-path"),
    pytest.param({"installer": None}, "expected an installer for its classes", id="classes-without-installer"),
    pytest.param({"classes": ("X",), "refused": ("X",)}, "installed or refused, got both", id="both"),
])
def test_an_entry_is_validated_when_made(change, match):
    entry = dict(name="t", kind="recurrent", function="m:f", reference="m:r", classes=("X",), installer="m:i")
    with pytest.raises(ValueError, match=match):
        MixerFamily(**{**entry, **change})


@pytest.mark.parametrize("entry, match", [
    pytest.param(dict(classes=("Qwen3NextGatedDeltaNet",), installer="m:i"), "classes of no other family", id="class-taken"),
    pytest.param(dict(refused=("Qwen4ExpTextGatedDeltaNet",)), "classes of no other family", id="refused-taken"),
    pytest.param(dict(layer="gated_delta"), "expected a new verifier layer", id="layer-taken"),
    pytest.param(dict(kind="no_such_kind"), "expected a kind of", id="unknown-kind"),
])
def test_registering_a_family_that_collides_is_refused(entry, match):
    fam = MixerFamily(**{"name": "t", "kind": "recurrent", "function": "m:f", "reference": "m:r", **entry})
    with pytest.raises(ValueError, match=match):
        register_family(fam)
    assert "t" not in FAMILIES


def test_the_docs_example_family_is_installed_by_the_guard_from_its_entry():
    """docs/hybrid.md's RunningSum (its asserts: known to the guard, installed under a step, equal to the
    reference; the stock forward outside a step), run twice: a name registered again replaces its entry."""
    try:
        for _ in range(2):
            ns = mixer_checks.docs_example("running_sum")
        assert FAMILIES["running_sum"].load("function") is ns["running_sum"]
    finally:
        FAMILIES.pop("running_sum", None)
        guard.KNOWN_MIXERS.pop("RunningSum", None)
    assert "RunningSum" not in guard.KNOWN_MIXERS and family_of_class("RunningSum") is None


def test_a_refused_class_of_a_family_is_refused_naming_the_layer():
    Qwen4ExpTextGatedDeltaNet = type("Qwen4ExpTextGatedDeltaNet", (nn.Module,), {"forward": lambda self, x: x})
    model = nn.Sequential(nn.Identity(), Qwen4ExpTextGatedDeltaNet())
    ids = torch.tensor([[1] * 4 + [2] * 4])
    from blockdiag_dist import make_cp_blockdiag_batch_and_ctx

    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.randn(1, 8, 2), "_packed_seq_ids": ids},
                                                 expect_attention=False)
    with pytest.raises(guard.UnsupportedLayerError, match=r"layer '1' \(Qwen4ExpTextGatedDeltaNet\).*Gated DeltaNet"):
        with ctx():
            model(batch["inputs_embeds"])
