"""Attention variants of transformers models carried under CP: tiny gpt-oss (sinks, sliding and full layers, MoE),
Llama 4 as released (chunked local attention, chunks of 8; NoPE temperature tuning on) and Gemma 2 (logit
soft-capping, sliding layers), float64, at CP 1,
2 and 4: the loss and every parameter's gradient against each document run alone through the model's own stock
attention with the same weights (``verify.model.harness``).

Two layouts: documents 20, 12, 16 in a row of 48, and 7, 26, 11 with 2 padding tokens (46), where no chunk
boundary (counted from a document's start) falls on a rank boundary at CP 2 or 4. Dropping a variant in the
attention function (what the integration did before) moves the result by more than 1e-3, and so does Llama 4's
temperature from the rows' positions (what the model computes once packed): the limit below is far from it. What
stays refused (per-token sinks, unknown layer types) raises.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the 'hf' extra: pip install -e '.[hf]')"
)

import blockdiag_dist.integrations.hf as hf_integration  # noqa: E402
from blockdiag_dist import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from blockdiag_dist.integrations import pack_documents  # noqa: E402
from blockdiag_dist.integrations.hf import UnsupportedAttentionError, blockdiag_attention_forward  # noqa: E402
from examples.hf_variants import VARIANT_MODELS, build_variant_models, cp_variant_steps, documents  # noqa: E402
from verify.model.harness import compare, cp_step, document_reference, text_forward  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TASK_TIMEOUT_S = 180.0  # per step on every rank: a deadline for hangs, not a speed limit
LAYOUTS = {"20-12-16": ((20, 12, 16), 48), "7-26-11-pad2": ((7, 26, 11), 46)}
# The models compute parts in float32 even in a float64 model: every RMSNorm (gpt-oss, Llama 4, Gemma 2), Llama
# 4's rotary embedding, and Gemma 2's eager attention its softmax. Measured worst relative error against the truth:
# gpt-oss 9e-16, Llama 4 6e-8 (float32 rounding flipping on a few elements at CP 4), Gemma 2 3e-7 (its float32
# softmax; 3e-7 at CP 1 already). The limit leaves room for those and is 1000x below what dropping a variant costs.
LIMIT = 1e-6
# One pool of 4 ranks: CP 4 over all of them, and CP 2 as two groups of 2 side by side (a ("dp", "cp") mesh), each
# group running another model. Every layout of every model also runs at CP 1, in this process.
ROUNDS = [  # (CP size, one (model, layout) per CP group)
    (2, [("gpt-oss", "20-12-16"), ("llama4", "20-12-16")]),
    (2, [("gemma2", "20-12-16"), ("llama4", "7-26-11-pad2")]),
    (4, [("gpt-oss", "20-12-16")]),
    (4, [("llama4", "20-12-16")]),
    (4, [("gemma2", "20-12-16")]),
    (4, [("llama4", "7-26-11-pad2")]),
]


@functools.lru_cache(maxsize=None)
def truth(name: str, layout: str):
    """(each document alone through the stock twin, the model itself) for ``name`` on ``layout``."""
    lengths, _ = LAYOUTS[layout]
    model, stock = build_variant_models(name)
    return document_reference(stock, documents(lengths)), model


def cp1(name: str, layout: str):
    lengths, seq_len = LAYOUTS[layout]
    model, _ = build_variant_models(name)
    return cp_step(model, pack_documents(documents(lengths), seq_len=seq_len), None)


def test_variants_match_each_document_alone_at_cp_1_2_and_4(pools):
    results = {(1, m, lay): cp1(m, lay) for m in VARIANT_MODELS for lay in LAYOUTS}
    calls = [(([(m, *LAYOUTS[lay]) for m, lay in runs], cp), {}) for cp, runs in ROUNDS]
    names = [f"CP {cp}: " + ", ".join(f"{m} {lay}" for m, lay in runs) for cp, runs in ROUNDS]
    for (cp, runs), per_rank in zip(ROUNDS, pools(4).run_many(cp_variant_steps, calls, timeout=TASK_TIMEOUT_S, names=names)):
        assert isinstance(per_rank, list), per_rank
        for g, (m, lay) in enumerate(runs):
            group = per_rank[g * cp : (g + 1) * cp]
            assert all(r.loss == group[0].loss for r in group), f"{m} {lay}: the ranks of a CP group disagree"
            results[cp, m, lay] = group[0]
    failures = []
    for (world, m, lay), got in results.items():
        ref, model = truth(m, lay)
        c = compare(ref, got, model, LIMIT)
        assert got.targets == ref.targets
        if not c.ok:
            failures.append(f"{m} {lay} CP {world}: {c.summary()}")
    assert not failures, "\n".join(failures)


def _dropping(variant: str):
    """The attention function with one variant silently dropped (as the integration did before carrying it)."""
    real = hf_integration.cp_blockdiag_sdpa

    def call(*args, **kwargs):
        kwargs[variant] = None
        return real(*args, **kwargs)

    return call


@pytest.mark.parametrize("name, variant", [("gpt-oss", "sinks"), ("llama4", "chunk_size"), ("gemma2", "softcap")])
def test_dropping_the_variant_is_far_outside_the_limit(name, variant, monkeypatch):
    monkeypatch.setattr(hf_integration, "cp_blockdiag_sdpa", _dropping(variant))
    ref, model = truth(name, "20-12-16")
    assert compare(ref, cp1(name, "20-12-16"), model, LIMIT).worst > 1e3 * LIMIT


def test_nope_temperature_from_the_rows_is_far_outside_the_limit(monkeypatch):
    """Llama 4's NoPE layers scale queries by their positions in the rows (``torch.arange``): kept as the model
    computes it (the layer's scale not divided out, no per-document temperature), the packed step is wrong."""
    monkeypatch.setattr(hf_integration, "_without_row_temperature", lambda query, key, temperature: query)
    monkeypatch.setattr(hf_integration, "cp_blockdiag_sdpa", _dropping("temperature"))
    ref, model = truth("llama4", "20-12-16")
    assert compare(ref, cp1("llama4", "20-12-16"), model, LIMIT).worst > 1e3 * LIMIT


def test_nope_temperature_with_a_bad_floor_scale_is_refused():
    model, _ = build_variant_models("llama4", stock=False)
    model.model.layers[1].self_attn.floor_scale = 0
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, pack_documents(documents((20, 12, 16)), seq_len=48))
    with pytest.raises(UnsupportedAttentionError, match=r"Llama4TextAttention: expected NoPE temperature tuning with a "
                       r"number floor_scale > 0.*got floor_scale=0"):
        with ctx():
            text_forward(model, batch)


class _Layer(torch.nn.Module):
    def __init__(self, config=None, layer_idx=None):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True


@pytest.mark.parametrize(
    "layer, kwargs, match",
    [
        pytest.param(_Layer(), {"sinks": torch.zeros(1, 2, 5, 1)}, "per-token attention sinks", id="per-token-sinks"),
        pytest.param(_Layer(), {"s_aux": torch.zeros(1, 2)}, r"s_aux: per-head attention sinks \[Hq\]", id="s_aux-2d"),
        pytest.param(_Layer(), {"softcap": -1.0}, "softcap=None or a number > 0", id="softcap-negative"),
        pytest.param(_Layer(type("C", (), {"attention_chunk_size": 8})()), {}, "without a layer type", id="chunk-no-layer-type"),
        pytest.param(_Layer(type("C", (), {"attention_chunk_size": 0, "layer_types": ["chunked_attention"]})(), 0), {},
                     "attention_chunk_size an int >= 1", id="chunk-0"),
    ],
)
def test_what_is_not_carried_is_refused(layer, kwargs, match):
    q = torch.zeros(1, 2, 5, 4)
    with pytest.raises(UnsupportedAttentionError, match=match):
        blockdiag_attention_forward(layer, q, q, q, None, **kwargs)


def test_a_full_layer_of_a_chunked_model_is_not_chunked():
    """``attention_chunk_size`` applies to the layers whose type says so: layer 1 of the tiny Llama 4 is full."""
    model, _ = build_variant_models("llama4")
    seen = []
    real = hf_integration.cp_blockdiag_sdpa
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_integration, "cp_blockdiag_sdpa", lambda *a, **k: seen.append(k["chunk_size"]) or real(*a, **k))
        ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, pack_documents(documents((9, 7)), seq_len=16))
        with ctx():
            text_forward(model, batch)
    assert seen == [8, None] and model.config.layer_types == ["chunked_attention", "full_attention"]
