"""Vision-language models under CP (tiny Qwen2.5-VL and Qwen3-VL with deepstack, from configs): the model's own
forward and NeMo's pre-shard recipe train at CP 1, 2 and 4, every layout, with the loss and every parameter's
gradient, vision tower included, equal to each document run alone through the stock model.

The stock models compute two steps in float32 even when float64 (:data:`verify.model.vlm_cases.FLOAT32_STEPS`:
RMS norms, the vision tower's q/k rotation), forward and backward. Judged at float64's resolution (<= 1e-10)
with those steps kept in float64 (:func:`~verify.model.vlm_cases.float64_throughout`); the stock model is judged
against the cost of its own float32 steps measured on one device.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the 'hf' extra: pip install -e '.[hf]')"
)

import blockdiag_dist.integrations.hf as hf  # noqa: E402
from blockdiag_dist import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from blockdiag_dist.integrations import mrope_position_ids, pack_documents, pack_multimodal_documents  # noqa: E402
from blockdiag_dist.integrations.hf import UnsupportedAttentionError  # noqa: E402
from blockdiag_dist.state import DecoderEntryNotShardedError  # noqa: E402
from blockdiag_ref import doc_ids_from_batch  # noqa: E402
from examples.vlm import IMAGE_TOKEN, MERGE, build_tiny_vlm, image_document, vlm_forward  # noqa: E402
from verify.model.harness import Comparison, compare  # noqa: E402
from verify.model.vlm_cases import (  # noqa: E402
    RECIPES,
    SEQ_LEN,
    documents,
    error_of,
    float64_throughout,
    multimodal_document_reference,
    packed_batch,
    run_case,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
LAYOUTS = ("contiguous", "balanced", "auto")
FLOAT64_LIMIT = 1e-10
BF16_FLOOR = 1e-5
TASK_TIMEOUT_S = 240.0  # per pool task on every rank: a deadline for hangs, not a speed limit
DOCS_SEED = 1  # run_case(seed=0) draws its documents from seed + 1


@functools.lru_cache(maxsize=None)
def truth(family: str, in_float64: bool = True, dtype: torch.dtype = torch.float64, autocast: bool = False):
    """(stock model, each document alone through it): the reference of every comparison."""
    model = build_tiny_vlm(family, attn_implementation="sdpa", dtype=dtype)
    docs = documents(DOCS_SEED, dtype)
    with float64_throughout() if in_float64 else torch.enable_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model, multimodal_document_reference(model, docs)


def judge(family: str, got, *, in_float64: bool = True) -> Comparison:
    model, ref = truth(family, in_float64)
    return compare(ref, got, model, FLOAT64_LIMIT)


def float32_cost(family: str) -> dict[str, float]:
    """Per module kind: how far the stock model's float32 steps move its gradients on one device (and 'loss')."""
    model, ref = truth(family, True)
    _, stock = truth(family, False)
    c = compare(ref, stock, model, 1.0)
    return {"loss": c.loss_rel, **{k: e for k, (e, _) in c.per_kind.items()}}


def stock_ok(family: str, got) -> str | None:
    """The stock model under CP: each group within 1e-10, or within twice its float32 steps' own cost."""
    model, ref = truth(family, False)
    c = compare(ref, got, model, 1.0)
    cost = float32_cost(family)
    worst = {"loss": c.loss_rel, **{k: e for k, (e, _) in c.per_kind.items()}}
    bad = {k: e for k, e in worst.items() if e > max(FLOAT64_LIMIT, 2 * cost[k])}
    return None if not bad else f"{c.summary()}; over 2 x the float32 cost {cost}: {bad}"


# ---- 1. the vision tower runs locally, decided per module ---------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_the_vision_tower_computes_exactly_what_stock_sdpa_computes(family):
    stock, ours = build_tiny_vlm(family, attn_implementation="sdpa"), build_tiny_vlm(family)
    grid = torch.tensor([[1, 4, 8], [1, 4, 4]])  # Qwen2.5-VL: 2 windows in the first image, 1 in the second
    pixels = torch.randn(48, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = stock.model.visual(pixels, grid_thw=grid).pooler_output
    assert torch.equal(ours.model.visual(pixels, grid_thw=grid).pooler_output, want), "outside a step"
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, pack_documents([[1, 2, 3]], seq_len=5), expect_attention=False)
    with ctx():
        assert torch.equal(ours.model.visual(pixels, grid_thw=grid).pooler_output, want), "under a step"
    assert any("VisionAttention: bidirectional attention over tensors CP does not shard" in n for n in ctx.state.notes)


def test_encoder_attention_honours_its_segments():
    model = build_tiny_vlm("qwen2_5_vl")
    layer = model.model.visual.blocks[0].attn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out, _ = hf.blockdiag_attention_forward(layer, q, k, v, None, is_causal=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
                      for a, b in ((0, 4), (4, 9))], dim=2).transpose(1, 2)
    assert torch.equal(out, want)
    with pytest.raises(UnsupportedAttentionError, match=r"cu_seq_lens_q=\[0, 4, 9\], cu_seq_lens_k=\[0, 9\]"):
        hf.blockdiag_attention_forward(layer, q, k, v, None, is_causal=False, cu_seq_lens_q=cu,
                                       cu_seq_lens_k=torch.tensor([0, 9]))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bidirectional_layer_of_the_language_model_is_refused(family):
    """Decided per module: a decoder layer made bidirectional runs on the sharded sequence: refused, while the
    vision tower's bidirectional layers run."""
    model = build_tiny_vlm(family)
    model.model.language_model.layers[1].self_attn.is_causal = False
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, packed_batch(documents(DOCS_SEED)), shard_primary=False)
    with pytest.raises(UnsupportedAttentionError, match="is_causal=False in a layer of the language model"), ctx():
        vlm_forward(model, local)


def test_a_bidirectional_layer_outside_any_encoder_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM._from_config(config, attn_implementation=hf.register_transformers_attention())
    model.model.layers[0].self_attn.is_causal = False
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, pack_documents([[1, 2, 3], [4, 5]], seq_len=6))
    with pytest.raises(UnsupportedAttentionError, match="is_causal=False in not an encoder's layer"), ctx():
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)


# ---- 4. documents from mRoPE positions -----------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_the_mrope_rule_is_the_models_get_rope_index(family):
    """Documents opening with text, with an image (its first token (0, 0, 0)), text only, an image in the middle:
    the collator's positions are the model's own, and the positions alone give the documents."""
    model = build_tiny_vlm(family)
    docs = documents(DOCS_SEED)
    for doc in docs:
        ids = doc["input_ids"]
        own = model.model.get_rope_index(ids[None], (ids == IMAGE_TOKEN).long()[None],
                                         image_grid_thw=doc.get("image_grid_thw"))[0][:, 0]
        ours = mrope_position_ids(ids, doc.get("image_grid_thw"), image_token_id=IMAGE_TOKEN, spatial_merge_size=MERGE)
        assert torch.equal(ours, own)
    assert docs[1]["input_ids"][0] == IMAGE_TOKEN
    batch = packed_batch(docs)
    assert batch["position_ids"][:, 0, 29].tolist() == [0, 0, 0] and batch["position_ids"][:, 0, 30].tolist() == [0, 0, 1]
    assert torch.equal(
        pack_multimodal_documents(docs, SEQ_LEN, image_token_id=IMAGE_TOKEN, spatial_merge_size=MERGE,
                                  rope_index=model.model.get_rope_index)["position_ids"], batch["position_ids"])
    found = doc_ids_from_batch({"position_ids": batch["position_ids"]}, SEQ_LEN, 2)
    real = batch["_packed_seq_ids"] != 0
    assert torch.equal(found[real], batch["_packed_seq_ids"][real])


def test_an_mrope_restart_the_rule_cannot_read_raises():
    batch = packed_batch(documents(DOCS_SEED))
    positions = batch["position_ids"].clone()
    positions[:, 0, 29:] += 5  # row 0's second document starts at (5, 5, 5), below where the first one got to
    with pytest.raises(ValueError, match=r"row 0, position 29 at \(5, 5, 5\) after \(24, 24, 24\) at position 28"):
        doc_ids_from_batch({"position_ids": positions}, SEQ_LEN, 2)


# ---- 2, 3, 7. parity ----------------------------------------------------------------------------------
CASES = list(itertools.product(FAMILIES, RECIPES, LAYOUTS))


def _failures(world: int, results) -> list[str]:
    out = []
    for (family, recipe, layout), got in zip(CASES, results):
        c = judge(family, got)
        if not c.ok:
            out.append(f"CP {world} {family} {recipe} {layout}: {c.summary()}")
        if recipe == "own" and not any("decoder entry sharded" in n for n in got.notes):
            out.append(f"CP {world} {family} {recipe} {layout}: the decoder entry was not sharded ({got.notes})")
    return out


def test_parity_at_cp1():
    results = [run_case(f, r, layout, in_float64=True) for f, r, layout in CASES]
    failures = _failures(1, results)
    for family in FAMILIES:
        why = stock_ok(family, run_case(family, "own", "balanced"))
        if why:
            failures.append(f"CP 1 {family} stock: {why}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_parity_at_cp2_and_cp4(pools, world):
    """Both recipes, every layout, with the float32 steps kept in float64 (<= 1e-10); the stock models by the
    model's own forward in the balanced layout (within twice the cost of their float32 steps), with the vision
    tower's images sharded (at CP 4, fewer images than ranks: replicated, and noted)."""
    stock = [(f, "own", "balanced") for f in FAMILIES]
    calls = [((f, r, layout), {"in_float64": True}) for f, r, layout in CASES]
    calls += [(c, {"shard_vision": True}) for c in stock]
    names = [f"CP {world} {c}" for c, _ in calls]
    outcomes = list(pools(world).run_many(run_case, calls, timeout=TASK_TIMEOUT_S, names=names))
    assert all(isinstance(o, list) for o in outcomes), next(o for o in outcomes if not isinstance(o, list))
    results = [o[0] for o in outcomes]
    failures = _failures(world, results[: len(CASES)])
    for (family, _, _), got in zip(stock, results[len(CASES):]):
        why = stock_ok(family, got)
        if why:
            failures.append(f"CP {world} {family} stock: {why}")
        expect = "images sharded over 2 CP ranks" if world == 2 else "fewer images than CP ranks (3 < 4)"
        if not any(expect in n for n in got.notes):
            failures.append(f"CP {world} {family} shard_vision: expected a note '{expect}', got {got.notes}")
    assert not failures, "\n".join(failures)


def test_checkpointing_autocast_and_documents_from_positions_at_cp2(pools):
    """Activation checkpointing (vision blocks and decoder layers recomputed), bf16 autocast, a batch whose
    documents are given only by its mRoPE positions (no _packed_seq_ids: the silent case of the issue), and the
    vision tower's images sharded across the ranks (shard_vision=True: 3 images, 2 ranks)."""
    checks = [((f, "own", "balanced"), {"checkpointing": ck, "in_float64": True})
              for f in FAMILIES for ck in ("reentrant", "non_reentrant")]
    checks += [((f, r, "balanced"), {"doc_ids": False, "in_float64": True}) for f in FAMILIES for r in RECIPES]
    checks += [((f, "own", layout), {"shard_vision": True, "in_float64": True}) for f in FAMILIES for layout in LAYOUTS]
    bf16 = [((f, "own", "balanced"), {"dtype": "float32", "autocast": "bfloat16"}) for f in FAMILIES]
    calls = checks + bf16
    names = [f"CP 2 {a} {k}" for a, k in calls]
    outcomes = list(pools(2).run_many(run_case, calls, timeout=TASK_TIMEOUT_S, names=names))
    assert all(isinstance(o, list) for o in outcomes), next(o for o in outcomes if not isinstance(o, list))
    failures = []
    for (args, kwargs), o in zip(checks, outcomes):
        c = judge(args[0], o[0])
        if not c.ok:
            failures.append(f"{args} {kwargs}: {c.summary()}")
        if kwargs.get("shard_vision") and not any("3 images sharded over 2 CP ranks" in n for n in o[0].notes):
            failures.append(f"{args} {kwargs}: the images were not sharded ({o[0].notes})")
    for (args, _), o in zip(bf16, outcomes[len(checks):]):
        model, exact = truth(args[0], False)
        _, single = truth(args[0], False, torch.float32, True)  # the same computation on one device
        ours, theirs = compare(exact, o[0], model, 1.0), compare(exact, single, model, 1.0)
        for kind, (err, name) in ours.per_kind.items():
            if err > 2 * theirs.per_kind[kind][0] + BF16_FLOOR:
                failures.append(f"bf16 {args[0]} {kind}: {err:.2e} ({name}) > 2 x {theirs.per_kind[kind][0]:.2e}")
        if ours.loss_rel > 2 * theirs.loss_rel + BF16_FLOOR:
            failures.append(f"bf16 {args[0]} loss: {ours.loss_rel:.2e} > 2 x {theirs.loss_rel:.2e}")
    assert not failures, "\n".join(failures)


def test_checkpointing_recomputes_the_vision_tower_and_the_decoder(monkeypatch):
    calls = []
    real = hf._encoder_attention

    def spy(*args, **kwargs):
        calls.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "_encoder_attention", spy)
    plain = run_case("qwen3_vl", "own", "contiguous")
    n = len(calls)
    ck = run_case("qwen3_vl", "own", "contiguous", checkpointing="non_reentrant")
    assert n > 0 and len(calls) - n == 2 * n, "expected each vision block's attention once, then again in backward"
    assert ck.loss == plain.loss


# ---- misuse is loud ------------------------------------------------------------------------------------
def test_the_models_forward_on_a_sharded_primary_stream_is_refused_on_every_rank(pools):
    got = pools(2).run(error_of, args=(run_case, "qwen2_5_vl", "own"), kwargs={"shard_primary": True},
                       timeout=TASK_TIMEOUT_S, name="own forward with shard_primary=True")
    assert all(m is not None and "pixel values under a CP step built with shard_primary=True" in m for m in got), got


def test_shard_primary_false_without_a_decoder_entry_raises():
    from examples.hf import build_tiny_hf
    from examples.training import TrainConfig

    model = build_tiny_hf(TrainConfig(dtype="float64"), "llama")
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, pack_documents([[1, 2, 3], [4, 5]], seq_len=6),
                                                 shard_primary=False)
    assert batch["input_ids"].shape == (1, 6)
    with pytest.raises(DecoderEntryNotShardedError, match="shard_primary=False .* without any decoder entry"):
        with ctx():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)


@pytest.mark.parametrize("edit, match", [
    pytest.param(lambda b: b["input_ids"].__setitem__((0, 5), 7),
                 r"image tokens \(120\): expected 16, .* got 15 \(row 0 document 1: 7, row 0 document 2: 4", id="token-missing"),
    pytest.param(lambda b: (b["input_ids"].__setitem__((0, 11), 9), b["input_ids"].__setitem__((0, 33), IMAGE_TOKEN)),
                 r"image 0 \(grid \[1, 4, 8\], 8 tokens\): expected its tokens within one document, got them in documents \[1, 2\]",
                 id="image-across-documents"),
    pytest.param(lambda b: b.update(pixel_values=b["pixel_values"][:-1]),
                 r"pixel_values: expected 64 rows, one per patch", id="patches"),
])
def test_image_tokens_that_do_not_match_the_features_raise_before_the_model_computes(edit, match):
    model = build_tiny_vlm("qwen3_vl")
    batch = packed_batch(documents(DOCS_SEED))
    edit(batch)
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, batch, shard_primary=False)
    with pytest.raises(ValueError, match=match), ctx():
        vlm_forward(model, local)
    assert not any("decoder entry" in n for n in ctx.state.notes)


def test_the_collator_names_the_document_whose_images_do_not_match():
    g = torch.Generator().manual_seed(0)
    good = image_document([5], (1, 4, 4), [6], g)
    bad = dict(good, input_ids=torch.cat([good["input_ids"][:2], good["input_ids"][3:]]))  # an image token missing
    with pytest.raises(ValueError, match=r"docs\[1\]: image 0 \(grid t=1, h=4, w=4, spatial_merge_size=2\): expected 4 "
                                         r"image tokens .*got 3"):
        pack_multimodal_documents([good, bad], 16, image_token_id=IMAGE_TOKEN, spatial_merge_size=MERGE)
    with pytest.raises(ValueError, match=r"docs\[0\]: pixel_values: expected \[16, F\].*got shape \(15, 24\)"):
        pack_multimodal_documents([dict(good, pixel_values=good["pixel_values"][1:])], 16, image_token_id=IMAGE_TOKEN,
                                  spatial_merge_size=MERGE)
