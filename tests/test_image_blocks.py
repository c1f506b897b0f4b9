"""Gemma 3 and Gemma 4 (images) and PaliGemma (a bidirectional prefix) under CP: tiny models from configs (no
download), float64, trained at CP 1, 2 and 4, every layout, with the loss and every parameter's gradient, vision
tower included, equal to each document run alone through the stock model (``sdpa``) with its token types
(verify.model.image_blocks: images and prefixes cross rank edges; Gemma 4's images are longer than its sliding
window, which they see beyond). Gemma's RMS norms, which normalise in float32 even in a float64 model, are kept in
float64 on both sides (``float64_norms``). Also: the integration refuses what it cannot compute, naming the layer,
and a model that ignored the blocks, or bounded Gemma 4's by the window, would fail these comparisons.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the 'hf' extra: pip install -e '.[hf]')"
)

from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx  # noqa: E402
from blockdiag_dist.guard import UnsupportedLayerError  # noqa: E402
from blockdiag_dist.integrations import vlm  # noqa: E402
from verify.model import image_blocks as ib  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LAYOUTS = ("contiguous", "balanced", "auto")
TASK_TIMEOUT_S = 240.0  # per pool task on every rank: a deadline for hangs, not a speed limit


@functools.lru_cache(maxsize=None)
def truth(family: str):
    """(stock model, each document alone through it)."""
    model = ib.build(family, attn_implementation=ib.STOCK_ATTENTION.get(family, "sdpa"))
    with ib.float64_norms():
        return model, ib.document_reference(model, ib.documents(family, 1))


def _failures(world: int, cases, results) -> list[str]:
    out = []
    for (family, layout, kernel), got in zip(cases, results):
        model, ref = truth(family)
        out += [f"CP {world} {family} {layout} {kernel}: {f}" for f in ib.judge(ref, got, model)]
        if not any(f"bidirectional blocks from {ib.TYPES[family]}" in n for n in got.notes):
            out.append(f"CP {world} {family} {layout}: the blocks did not reach the step ({got.notes})")
    return out


def test_parity_at_cp1_and_the_blocks_matter(monkeypatch):
    """CP 1 on both kernels; and the check is sharp: with Gemma 4's blocks bounded by its sliding window (Gemma 3's
    rule) the comparison fails for Gemma 4, and with the blocks dropped (causal text attention) it fails for every
    model."""
    cases = [(f, "contiguous", k) for f in ib.FAMILIES for k in ("varlen", "dense")]
    results = [ib.run_case(f, layout, kernel=k) for f, layout, k in cases]
    assert not (failures := _failures(1, cases, results)), "\n".join(failures)
    rule = vlm.BIDIRECTIONAL_MODELS["Gemma4UnifiedModel"]
    monkeypatch.setitem(vlm.BIDIRECTIONAL_MODELS, "Gemma4UnifiedModel", dataclasses.replace(rule, whole=False))
    model, ref = truth("gemma4_unified")
    assert ib.judge(ref, ib.run_case("gemma4_unified"), model), "gemma4_unified: blocks within the window passed"
    monkeypatch.setattr(vlm, "_step_blocks", lambda *a: None)
    for family in ib.FAMILIES:
        model, ref = truth(family)
        assert ib.judge(ref, ib.run_case(family), model), f"{family}: causal attention passed for bidirectional blocks"


@pytest.mark.parametrize("world", [2, 4])
def test_parity_at_cp2_and_cp4(pools, world):
    """Every layout (the varlen kernel; the dense one on the contiguous layout): images and prefixes cross rank
    edges, their later keys come from later ranks and their gradients go back."""
    cases = [(f, layout, "varlen") for f, layout in itertools.product(("gemma3", "paligemma"), LAYOUTS)]
    cases += [(f, "contiguous", "dense") for f in ("gemma3", "paligemma")]
    # images and prefixes longer than a sliding window, seen whole (few cases: time; the kernels' paths are
    # tests/test_bidirectional.py's): Gemma 4, whose images' keys before the window come from other ranks, and
    # PaliGemma with Gemma 2's sliding layer at CP 2
    cases += [("gemma4_unified", "contiguous", "varlen"), ("paligemma2", "balanced", "varlen")] if world == 2 else [
        ("gemma4_unified", "balanced", "varlen")]
    calls = [((f, layout), {"kernel": k}) for f, layout, k in cases]
    outcomes = list(pools(world).run_many(ib.run_case, calls, timeout=TASK_TIMEOUT_S,
                                          names=[f"CP {world} {c}" for c in cases]))
    assert all(isinstance(o, list) for o in outcomes), next(o for o in outcomes if not isinstance(o, list))
    assert not (failures := _failures(world, cases, [o[0] for o in outcomes])), "\n".join(failures)


def test_what_stays_refused_names_the_layer():
    """token types sharded to the rank's rows (shard_primary=True) are refused at the model's entry, naming the layer;
    so are PaliGemma's layers in a step whose model entry was not seen, and PaliGemma without token_type_ids."""
    model = ib.build("gemma3")
    batch = ib.packed_batch("gemma3", ib.documents("gemma3"))
    batch.pop("pixel_values")  # text only: the blocks are read from token_type_ids whatever the images
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, dict(batch))
    with pytest.raises(ValueError, match=r"Gemma3Model: token_type_ids: expected the full rows \[B, S\] = \[2, 24\] under a "
                                         r"CP step built with shard_primary=False .* got shape \(2, 24\) with shard_primary=True"):
        with ctx():
            model(input_ids=local["input_ids"], token_type_ids=local["token_type_ids"], position_ids=local["position_ids"],
                  use_cache=False)
    fresh = ib.build("paligemma")  # its inner model called first: the scan hooks it too late for this call
    batch = ib.packed_batch("paligemma", ib.documents("paligemma"))
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, dict(batch), shard_primary=False)
    with pytest.raises(ValueError, match=r"blockdiag_cp attention in GemmaAttention: expected the bidirectional blocks its "
                                         r"model reads from token_type_ids .*got a layer of the language model of a Gemma3Model / "
                                         r"PaliGemmaModel .*the model itself was the step's first call"):
        with ctx():
            fresh.model(**{k: local[k] for k in ("input_ids", "token_type_ids", "position_ids", "pixel_values")},
                        use_cache=False)
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, {k: v for k, v in batch.items() if k != "token_type_ids"},
                                                 shard_primary=False)
    with pytest.raises(UnsupportedLayerError, match=r"layer PaliGemmaModel is not computed per document under CP without "
                                                    r"token_type_ids: expected token_type_ids \[B, S\]"), ctx():
        fresh(**{k: local[k] for k in ("input_ids", "position_ids", "pixel_values")}, use_cache=False)
    g4 = ib.build("gemma4_unified")
    batch = ib.packed_batch("gemma4_unified", ib.documents("gemma4_unified"))
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, {k: v for k, v in batch.items() if "pixel" not in k})
    with pytest.raises(ValueError, match=r"Gemma4UnifiedModel: mm_token_type_ids: expected the full rows \[B, S\] = \[2, 24\] "
                                         r"under a CP step built with shard_primary=False .* with shard_primary=True"), ctx():
        g4(input_ids=local["input_ids"], mm_token_type_ids=local["mm_token_type_ids"], position_ids=local["position_ids"],
           use_cache=False)
    from blockdiag_dist.guard import KNOWN_MIXERS

    assert not {"Gemma3Model", "PaliGemmaModel", "Gemma4UnifiedModel"} & KNOWN_MIXERS.keys()


def test_outside_a_step_after_one_stays_refused():
    """After a step has hooked the models, a call outside any step is refused, not run causally: PaliGemma's
    layers (is_causal=False) the same as before any step, Gemma 3 and 4 with image tokens in their token types at
    their model's entry; Gemma 3 without image tokens runs (plain causal text is what the stock model computes)."""
    from blockdiag_dist.integrations.hf import UnsupportedAttentionError

    for family, error in (("paligemma", UnsupportedAttentionError), ("gemma4_unified", UnsupportedLayerError),
                          ("gemma3", UnsupportedLayerError)):
        model = ib.build(family)
        batch = ib.packed_batch(family, ib.documents(family))
        full = {k: batch[k] for k in ("input_ids", ib.TYPES[family], "position_ids", "pixel_values", "image_position_ids")
                if k in batch}
        if family == "paligemma":
            with pytest.raises(error, match=r"got is_causal=False in not an encoder's layer"):
                model(**full, use_cache=False)
        ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, dict(batch), shard_primary=False)
        with ctx():
            model(**{k: local[k] for k in full}, use_cache=False)
        match = {"paligemma": r"got is_causal=False in a layer of the language model",
                 "gemma3": r"layer Gemma3Model is not computed outside a CP step with image tokens: expected token_type_ids "
                           r"without image tokens \(all 0\) outside a step, .* got \d+ image tokens",
                 "gemma4_unified": r"layer Gemma4UnifiedModel is not computed outside a CP step with image tokens: expected "
                                   r"mm_token_type_ids without image tokens \(none 1 or 2\) outside a step, .* got 16 image "
                                   r"tokens"}[family]
        with pytest.raises(error, match=match):
            model(**full, use_cache=False)
    text = dict(full, token_type_ids=torch.zeros_like(full["token_type_ids"]))
    text.pop("pixel_values")
    text["input_ids"] = torch.where(text["input_ids"] == ib.IMAGE_TOKEN, ib.BOS, text["input_ids"])
    assert torch.isfinite(model(**text, use_cache=False).logits).all()


def test_prefixes_and_images_beyond_the_sliding_window(monkeypatch):
    """PaliGemma's sliding layers (a Gemma 2 decoder, window 2) and Gemma 4's OR the block with the causal window: a
    prefix or image longer than the window is seen whole, at CP 1 on both kernels (CP 2 and 4 above); bounded by the
    window (Gemma 3's rule) the same comparison fails."""
    cases = [("paligemma2", "contiguous", k) for k in ("varlen", "dense")]
    results = [ib.run_case(f, layout, kernel=k) for f, layout, k in cases]
    assert not (failures := _failures(1, cases, results)), "\n".join(failures)
    rule = vlm.BIDIRECTIONAL_MODELS["PaliGemmaModel"]
    monkeypatch.setitem(vlm.BIDIRECTIONAL_MODELS, "PaliGemmaModel", dataclasses.replace(rule, whole=False))
    model, ref = truth("paligemma2")
    assert ib.judge(ref, ib.run_case("paligemma2"), model), "paligemma2: prefixes within the window passed"


def test_block_rules_equal_the_models_own():
    """The rules read the same blocks as the models' own ``get_block_sequence_ids_for_mask`` (ids shifted by one, 0
    for none where the model has -1): Gemma 3 from ``token_type_ids``, Gemma 4 from ``mm_token_type_ids`` (images 1
    and video frames 2 in one run, audio 3 outside any block); and Gemma 4 reads none when its text config builds
    none (``use_bidirectional_attention`` other than ``"vision"``)."""
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.gemma4_unified import modeling_gemma4_unified

    types = torch.randint(0, 4, (3, 40), generator=torch.Generator().manual_seed(0))
    types[0, :6] = torch.tensor([1, 2, 2, 0, 3, 1])
    g3 = vlm.BIDIRECTIONAL_MODELS["Gemma3Model"].blocks(types)
    assert torch.equal(g3, modeling_gemma3.get_block_sequence_ids_for_mask(types) + 1)
    from types import SimpleNamespace

    from torch import nn

    class Gemma4UnifiedModel(nn.Module):  # the rule is found by class name; only the text config's setting is read
        config = SimpleNamespace(use_bidirectional_attention="vision")

    g4 = Gemma4UnifiedModel()
    assert torch.equal(vlm.bidirectional_blocks_of(g4, types),
                       modeling_gemma4_unified.get_block_sequence_ids_for_mask(types, types.device) + 1)
    g4.config = SimpleNamespace(use_bidirectional_attention=None)
    assert vlm.bidirectional_blocks_of(g4, types) is None
