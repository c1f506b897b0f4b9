"""DeepSeek Sparse Attention models (DeepSeek-V3.2; GLM-5 with its shared-indexer layers) train under CP with the
same few lines as Llama: the loss and every parameter's gradient equal each document run alone on one device
(stock ``sdpa``), at CP 1, 2, 4, on contiguous and balanced layouts, with activation checkpointing (reentrant and
not) and without, in float64. (Refused by the guard before:
their indexer read the documents from a mask that a registered attention does not get.)

What the models compute in float32 whatever their dtype (identical op for op in the truth and under CP, see
verify.model.sparse): the indexer's scores, hence its top-k; the RMSNorms, whose weights' gradients are float32
sums over tokens (limit 1e-6, measured <= 2e-7). Everything else is held to 1e-10 (measured ~5e-16)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx, plan_step  # noqa: E402
from blockdiag_dist.guard import check_model  # noqa: E402
from verify.model.harness import compare, text_forward  # noqa: E402
from verify.model.sparse import build_tiny_dsa, cp_parity_step, dsa_batch, dsa_docs, float32_reduced, truth  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FLOAT64_LIMIT = 1e-10
FLOAT32_LIMIT = 1e-6
TIMEOUT = 300.0
_truths: dict = {}


def the_truth(family: str):
    if family not in _truths:
        _truths[family] = truth(family)
    return _truths[family]


def problems(label: str, family: str, got) -> list[str]:
    c = compare(the_truth(family), got, build_tiny_dsa(family), FLOAT64_LIMIT)
    bad = [f"{label}: loss {c.loss_rel:.1e}"] if c.loss_rel > FLOAT64_LIMIT else []
    for name, err in c.per_param.items():
        limit = FLOAT32_LIMIT if float32_reduced(name) else FLOAT64_LIMIT
        if err > limit:
            bad.append(f"{label}: {name} {err:.1e} > {limit:g} ({c.summary()})")
    cls = "GlmMoeDsaAttention" if family == "glm_moe_dsa" else "DeepseekV32Attention"
    if not any(n.startswith(f"{cls}: computed per document") for n in got.notes):
        bad.append(f"{label}: {cls} was not computed per document (notes {got.notes})")
    return bad


def test_cp1_matches_each_document_alone_and_the_selection_matters():
    """CP 1 (no communication) for both families; and the top-k is sparse here: keeping every key (a top-k
    above the longest document) changes the truth's gradients, so a selection ignored would be caught."""
    for family in ("deepseek_v32", "glm_moe_dsa"):
        assert not problems(f"{family} cp1", family, cp_parity_step(family))
    dense = compare(the_truth("deepseek_v32"), truth("deepseek_v32", topk=64), build_tiny_dsa("deepseek_v32"), FLOAT64_LIMIT)
    assert dense.per_param["model.layers.0.self_attn.q_b_proj.weight"] > 1e-2, dense.summary()


CP_RUNS = {  # CP size -> (family, layout, activation checkpointing)
    2: [("deepseek_v32", "balanced", None), ("glm_moe_dsa", "contiguous", "non_reentrant")],
    4: [("deepseek_v32", "contiguous", "reentrant"), ("glm_moe_dsa", "balanced", None)],
}


@pytest.mark.parametrize("cp", sorted(CP_RUNS))
def test_cp_matches_each_document_alone(pools, cp):
    runs = CP_RUNS[cp]
    calls = [((family,), {"layout": layout, "checkpointing": ck}) for family, layout, ck in runs]
    names = [f"{family} cp{cp} {layout} ckpt={ck}" for family, layout, ck in runs]
    found = []
    for name, (family, _, _), per_rank in zip(names, runs, pools(cp).run_many(cp_parity_step, calls, timeout=TIMEOUT,
                                                                           names=names)):
        assert isinstance(per_rank, list), per_rank
        found += problems(name, family, per_rank[0])
    ids = dsa_batch(dsa_docs())["_packed_seq_ids"]
    for _, layout, _ in runs:  # documents cross ranks: indexer keys and latents move
        assert sum(plan_step(ids, cp, layout).exchange(-1).needed_tokens()) > 0
    assert not found, "\n".join(found)


def test_under_a_step_a_mask_or_a_cache_is_refused_and_other_indexers_stay_refused():
    model = build_tiny_dsa("deepseek_v32")
    attn = model.model.layers[0].self_attn
    ctx, local = make_cp_blockdiag_batch_and_ctx(None, None, dsa_batch(dsa_docs()))
    with ctx():
        text_forward(model, local)  # installs the per-document forward
        h = torch.zeros(2, 64, 32, dtype=torch.float64)
        pe = model.model.rotary_emb(h, torch.arange(64).unsqueeze(0))
        with pytest.raises(ValueError, match=r"DeepseekV32Attention \(layer 0\): expected no attention_mask under a "
                                             r"CP step .*got a tensor of shape \(2, 1, 64, 64\)"):
            attn(h, pe, torch.ones(2, 1, 64, 64, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"expected no cache under a CP step .*got object"):
            attn(h, pe, None, cache=object())
    assert [f.per_document is not None for f in check_model(model) if f.kind == "sparse_attention"] == [True, True]

    class OtherAttention(torch.nn.Module):  # an indexer outside the installed layers stays refused, by name
        def __init__(self):
            super().__init__()
            self.indexer = type(attn.indexer)(model.config, 0)

    found = check_model(OtherAttention())
    assert [(f.name, f.cls, f.per_document) for f in found] == [("indexer", "DeepseekV32Indexer", None)]
    assert "layer 'indexer' (DeepseekV32Indexer) is not computed per document under CP: it is sparse attention" in found[0].message()
