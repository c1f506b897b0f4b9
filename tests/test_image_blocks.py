"""Gemma 3 (images) and PaliGemma (a bidirectional prefix) under CP: tiny models from configs (no download), float64,
trained at CP 1, 2 and 4, every layout, with the loss and every parameter's gradient, vision tower included, equal
to each document run alone through the stock model (``sdpa``) with its ``token_type_ids`` (verify.model.image_blocks:
images and prefixes cross rank edges). Gemma's RMS norms, which normalise in float32 even in a float64 model, are
kept in float64 on both sides (``float64_norms``). Also: the integration refuses what it cannot compute, naming the
layer, and a model that ignored the blocks would fail these comparisons.
"""

from __future__ import annotations

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
    model = ib.build(family, attn_implementation="sdpa")
    with ib.float64_norms():
        return model, ib.document_reference(model, ib.documents(family, 1))


def _failures(world: int, cases, results) -> list[str]:
    out = []
    for (family, layout, kernel), got in zip(cases, results):
        model, ref = truth(family)
        out += [f"CP {world} {family} {layout} {kernel}: {f}" for f in ib.judge(ref, got, model)]
        if not any("bidirectional blocks from token_type_ids" in n for n in got.notes):
            out.append(f"CP {world} {family} {layout}: the blocks did not reach the step ({got.notes})")
    return out


def test_parity_at_cp1_and_the_blocks_matter(monkeypatch):
    """CP 1 on both kernels; and the check is sharp: with the blocks dropped (causal text attention) the same
    comparison fails for both models."""
    cases = [(f, "contiguous", k) for f in ib.FAMILIES for k in ("varlen", "dense")]
    results = [ib.run_case(f, layout, kernel=k) for f, layout, k in cases]
    assert not (failures := _failures(1, cases, results)), "\n".join(failures)
    monkeypatch.setattr(vlm, "_step_blocks", lambda *a: None)
    for family in ib.FAMILIES:
        model, ref = truth(family)
        assert ib.judge(ref, ib.run_case(family), model), f"{family}: causal attention passed for bidirectional blocks"


@pytest.mark.parametrize("world", [2, 4])
def test_parity_at_cp2_and_cp4(pools, world):
    """Every layout (the varlen kernel; the dense one on the contiguous layout): images and prefixes cross rank
    edges, their later keys come from later ranks and their gradients go back."""
    cases = [(f, layout, "varlen") for f, layout in itertools.product(ib.FAMILIES, LAYOUTS)]
    cases += [(f, "contiguous", "dense") for f in ib.FAMILIES]
    calls = [((f, layout), {"kernel": k}) for f, layout, k in cases]
    outcomes = list(pools(world).run_many(ib.run_case, calls, timeout=TASK_TIMEOUT_S,
                                          names=[f"CP {world} {c}" for c in cases]))
    assert all(isinstance(o, list) for o in outcomes), next(o for o in outcomes if not isinstance(o, list))
    assert not (failures := _failures(world, cases, [o[0] for o in outcomes])), "\n".join(failures)


def test_what_stays_refused_names_the_layer():
    """token_type_ids sharded to the rank's rows (shard_primary=True) are refused at the model's entry; Gemma 4's
    model stays refused by the guard, naming the layer."""
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
    from blockdiag_dist.guard import KNOWN_MIXERS, MIXER_KINDS

    assert KNOWN_MIXERS["Gemma4UnifiedModel"] == "image_bidirectional" and "beyond the window" in MIXER_KINDS["image_bidirectional"]
    assert "Gemma3Model" not in KNOWN_MIXERS and "PaliGemmaModel" not in KNOWN_MIXERS


def test_outside_a_step_after_one_stays_refused():
    """After a step has hooked the models, a call outside any step is refused, not run causally: PaliGemma's
    layers (is_causal=False) the same as before any step, Gemma 3 with image tokens in token_type_ids at its
    model's entry; Gemma 3 without image tokens runs (plain causal text is what the stock model computes)."""
    from blockdiag_dist.integrations.hf import UnsupportedAttentionError

    for family, error in (("paligemma", UnsupportedAttentionError), ("gemma3", UnsupportedLayerError)):
        model = ib.build(family)
        batch = ib.packed_batch(family, ib.documents(family))
        full = {k: batch[k] for k in ("input_ids", "token_type_ids", "position_ids", "pixel_values")}
        if family == "paligemma":
            with pytest.raises(error, match=r"got is_causal=False in not an encoder's layer"):
                model(**full, use_cache=False)
        ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, dict(batch), shard_primary=False)
        with ctx():
            model(**{k: local[k] for k in full}, use_cache=False)
        match = (r"got is_causal=False in a layer of the language model" if family == "paligemma" else
                 r"layer Gemma3Model is not computed outside a CP step with image tokens: expected token_type_ids "
                 r"without image tokens \(all 0\) outside a step, .* got \d+ image tokens")
        with pytest.raises(error, match=match):
            model(**full, use_cache=False)
    text = dict(full, token_type_ids=torch.zeros_like(full["token_type_ids"]))
    text.pop("pixel_values")
    text["input_ids"] = torch.where(text["input_ids"] == ib.IMAGE_TOKEN, ib.BOS, text["input_ids"])
    assert torch.isfinite(model(**text, use_cache=False).logits).all()


def test_paligemma_prefix_beyond_the_sliding_window_is_refused():
    """PaliGemma's sliding layers OR its prefix with the window: a prefix spanning more than the window (first to
    last token, suffix tokens between them counted) is refused; one within it is given to the step."""
    from types import SimpleNamespace

    from torch import nn

    from blockdiag_dist.state import current_state

    class PaliGemmaModel(nn.Module):  # the rule is found by class name; only the text config's window is read
        config = SimpleNamespace(text_config=SimpleNamespace(sliding_window=8))

    batch = {"input_ids": torch.ones(1, 12, dtype=torch.long), "_packed_seq_ids": torch.ones(1, 12, dtype=torch.long)}
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch, shard_primary=False)
    split = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1]])  # 6 prefix tokens spanning 11 positions
    with ctx():
        with pytest.raises(ValueError, match=r"PaliGemmaModel: expected every bidirectional prefix within the text "
                                             r"model's sliding window \(8 tokens: .*got a prefix spanning 11 tokens"):
            vlm._step_blocks(PaliGemmaModel(), split, current_state())
        vlm._step_blocks(PaliGemmaModel(), torch.tensor([[0] * 8 + [1] * 4]), current_state())
        assert current_state().blocks is not None
        current_state().decoder_entries += 1  # no model runs here: the step's exit check counts decoder entries
        q = torch.randn(1, 1, 12, 2, dtype=torch.float64)
        assert torch.isfinite(cp_blockdiag_sdpa(q, q, q, is_causal=True, bidirectional_blocks=True)).all()
