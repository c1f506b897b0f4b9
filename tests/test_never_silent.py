"""Never silent on a model blockdiag_dist does not compute per document: one tiny model per architecture family
of the pinned transformers, trained with the README's recipe (``attn_implementation=register_transformers_attention()``,
``pack_documents``, ``make_cp_blockdiag_batch_and_ctx``, forward and backward in ``train_ctx()``), is refused on
every rank at CP 1 and CP 2 with a message naming the layer or variant, before any gradient exists.

Families computed per document instead (Gated DeltaNet, sinks, chunked attention, softcap, Llama 4's NoPE
temperature tuning, vision-language models; the Mamba2 layers of Nemotron-H, Bamba, Granite-4 hybrids, Zamba2,
Falcon-H1 and Mamba2 itself; the Mamba1 layers of Mamba, Falcon-Mamba, Jamba and Zamba; LFM2's short convolutions;
the KDA layers of Kimi Linear and Ling; MiniMax's lightning attention; the sparse attention of DeepSeek-V3.2, GLM-5, A.X-K2, HY-V4 and Mistral Large 4) have parity tests of their
own (test_hybrid*, test_hf_hybrid, test_hf_mamba2, test_hf_mamba1, test_hf_short_conv, test_hf_kda, test_hf_lightning,
test_attention_variants*, test_vlm, test_hf_sparse)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

import mp_checks  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

_DECODER = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, head_dim=8)
_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)

# (model type, config fields, error class, what the message must name)
FAMILIES = [
    pytest.param("recurrent_gemma", dict(_DECODER, num_key_value_heads=4, lru_width=64, attention_window_size=8,
                                         num_hidden_layers=3),
                 "UnsupportedLayerError", r"\(RecurrentGemmaRecurrentBlock\).*RG-LRU", id="recurrent-gemma-rglru"),
    pytest.param("xlstm", dict(vocab_size=128, hidden_size=64, embedding_dim=64, num_heads=4, num_hidden_layers=2),
                 "UnsupportedLayerError", r"\(xLSTMLayer\).*xLSTM", id="xlstm"),
    pytest.param("rwkv", dict(vocab_size=128, hidden_size=64, attention_hidden_size=64, intermediate_size=64,
                              num_hidden_layers=2),
                 "UnsupportedLayerError", r"\(RwkvSelfAttention\).*RWKV", id="rwkv"),
    pytest.param("bloom", dict(vocab_size=128, hidden_size=64, n_head=4, n_layer=2),
                 "UnsupportedLayerError", r"\(BloomAttention\).*ALiBi", id="bloom-alibi"),
    pytest.param("mpt", dict(d_model=64, n_heads=4, vocab_size=128, n_layers=2),
                 "UnsupportedLayerError", r"\(MptAttention\).*ALiBi", id="mpt-alibi"),
    pytest.param("falcon", dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=True),
                 "UnsupportedAttentionError", r"got Falcon.*ALiBi", id="falcon-alibi"),
    pytest.param("gpt_neo", dict(vocab_size=128, hidden_size=64, num_heads=4, num_layers=2, bos_token_id=127,
                                 eos_token_id=127, attention_types=[[["global", "local"], 1]]),
                 "UnsupportedAttentionError", r"got GPT-Neo", id="gpt-neo-own-attention"),
    pytest.param("xglm", dict(vocab_size=128, d_model=64, ffn_dim=64, attention_heads=4, num_layers=2),
                 "UnsupportedLayerError", r"\(XGLMAttention\).*computes itself", id="xglm-own-attention"),
    pytest.param("bart", dict(vocab_size=128, d_model=64, encoder_ffn_dim=64, decoder_ffn_dim=64,
                              encoder_attention_heads=4, decoder_attention_heads=4, decoder_layers=2),
                 "UnsupportedLayerError", r"\(BartDecoder\).*positional embedding computed from the row", id="bart-row-positions"),
    # DSA of dots.3 (DeepSeek-V3.2's, GLM-5's, A.X-K2's, HY-V4's and Mistral Large 4's are computed per document:
    # test_hf_sparse)
    pytest.param("dots3_note_text", dict(_DECODER, num_key_value_heads=4, **_MLA, **_MOE, q_lora_rank=32,
                                         n_routed_experts=4, index_topk=4, index_head_dim=16, index_n_heads=2,
                                         num_hidden_layers=2, bos_token_id=1, eos_token_id=2, pad_token_id=0),
                 "UnsupportedLayerError", r"\(Dots3NoteTextIndexer\).*sparse attention", id="dots3-sparse"),
]


@pytest.mark.parametrize("model_type, config, error, match", FAMILIES)
def test_refused_at_cp1(model_type, config, error, match):
    got, message = mp_checks.transformers_step_refusal(model_type, config)
    assert got == error, f"{model_type}: expected {error}, got {got or 'no error'}: {message[:300]}"
    assert re.search(match, message), message
    assert "expect_attention" not in message, "a refusal may not advise the opt-out"


def test_refused_on_every_rank_at_cp2(pools):
    """The same families in one 2-rank pool: every rank raises the same refusal (no rank left in a collective)."""
    calls = [((p.values[0], p.values[1]), {}) for p in FAMILIES]
    names = [p.id for p in FAMILIES]
    outcomes = list(pools(2).run_many(mp_checks.transformers_step_refusal, calls, timeout=120, names=names))
    assert len(outcomes) == len(FAMILIES), outcomes[-1]
    for p, per_rank in zip(FAMILIES, outcomes):
        _, _, error, match = p.values
        assert isinstance(per_rank, list), f"{p.id}: {per_rank}"
        assert [got for got, _ in per_rank] == [error, error], f"{p.id}: {[(g, m[:200]) for g, m in per_rank]}"
        assert per_rank[0][1] == per_rank[1][1] and re.search(match, per_rank[0][1]), per_rank[0][1]


def test_an_unknown_attention_keyword_is_refused_unless_none():
    """A keyword blockdiag does not know is refused (it may change the math), before any collective; passed as None
    it asks for nothing (BERT-style self-attention passes encoder_hidden_states=None) and is not."""
    import torch
    from torch import nn

    from blockdiag_dist.integrations.hf import UnsupportedAttentionError, _check_layer

    layer = nn.Linear(2, 2)
    _check_layer(layer, {"encoder_hidden_states": None, "position_ids": torch.zeros(1, 3)}, None)
    with pytest.raises(UnsupportedAttentionError, match=r"got \['encoder_hidden_states'\], which may change"):
        _check_layer(layer, {"encoder_hidden_states": torch.zeros(1, 3, 2)}, None)


def test_a_vision_encoders_own_attention_table_builds_with_stock_sdpa():
    """DeepSeek-VL-hybrid's high-resolution tower (SAM) picks its attention class from a table keyed by the
    implementation's name: under blockdiag's name it gets the table's SDPA class (bidirectional attention over
    image patches, which CP does not shard), instead of a KeyError at build."""
    import torch

    from blockdiag_dist.integrations import register_transformers_attention
    from verify.model.zoo import resolve

    name = register_transformers_attention()
    p = resolve("deepseek_vl_hybrid", tiny=True)
    with torch.device("meta"):
        model = p.model_class._from_config(p.config, attn_implementation=name)
    from transformers.models.sam.modeling_sam import SAM_VISION_ATTENTION_CLASSES

    sam = {type(m) for m in model.modules() if type(m).__name__.startswith("SamVision") and "Attention" in type(m).__name__}
    assert sam == {SAM_VISION_ATTENTION_CLASSES["sdpa"]}, sam
