"""The packing collator and the loss helpers: every output rule, every error (one process, no group)."""

import pytest
import torch

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.integrations import PackingCollator, causal_lm_loss, global_token_count, mesh_groups, pack_documents
from blockdiag_ref import DocLayout

DOCS = [[11, 12, 13, 14, 15], [21], [31, 32, 33], [41, 42, 43, 44, 45, 46, 47]]  # S = 8: rows [5 + 1], [3], [7]


def brute_labels(input_ids: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """label[t] = input_ids[t + 1] iff t and t + 1 are real tokens of one document, else -100."""
    out = torch.full_like(input_ids, -100)
    B, S = input_ids.shape
    for b in range(B):
        for t in range(S - 1):
            if seq_ids[b, t] != 0 and seq_ids[b, t] == seq_ids[b, t + 1]:
                out[b, t] = input_ids[b, t + 1]
    return out


def test_pack_documents_every_field():
    b = pack_documents(DOCS, seq_len=8, padding_token_id=7)
    assert b["input_ids"].tolist() == [
        [11, 12, 13, 14, 15, 21, 7, 7],
        [31, 32, 33, 7, 7, 7, 7, 7],
        [41, 42, 43, 44, 45, 46, 47, 7],
    ]
    assert b["_packed_seq_ids"].tolist() == [[1, 1, 1, 1, 1, 2, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0], [1] * 7 + [0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 0, 0], [0, 1, 2, 0, 0, 0, 0, 0], list(range(7)) + [0]]
    assert torch.equal(b["labels"], brute_labels(b["input_ids"], b["_packed_seq_ids"]))
    assert all(t.dtype == torch.int64 and t.shape == (3, 8) for t in b.values())


def test_adjacent_documents_with_equal_tokens_stay_apart():
    """Document ids count per row, so the reference sees one document per packed document (no merging)."""
    b = pack_documents([[5, 5], [5, 5, 5], [5]], seq_len=6)
    layout = DocLayout.from_doc_ids(b["_packed_seq_ids"])
    assert layout.cu_seqlens.diff().tolist() == [2, 3, 1]
    assert b["labels"].tolist() == [[5, -100, 5, 5, -100, -100]]


def test_rows_pads_with_empty_rows_and_full_rows_have_no_padding():
    b = pack_documents([[1, 2, 3], [4, 5, 6]], seq_len=3, rows=3)
    assert b["_packed_seq_ids"].tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0]]
    assert b["labels"][2].tolist() == [-100] * 3


def test_packed_batch_goes_through_the_batch_function_at_cp1():
    batch = pack_documents(DOCS, seq_len=8)
    expected = {k: v.clone() for k, v in batch.items()}
    _, out = make_cp_blockdiag_batch_and_ctx(None, None, batch)
    for k, v in expected.items():
        assert torch.equal(out[k], v), k
    assert torch.equal(out["padding_mask"], expected["_packed_seq_ids"] == 0)


def test_collator_accepts_sequences_tensors_and_mappings():
    collate = PackingCollator(seq_len=8, padding_token_id=7)
    features = [DOCS[0], torch.tensor(DOCS[1]), {"input_ids": DOCS[2], "attention_mask": [1, 1, 1]}, tuple(DOCS[3])]
    got, want = collate(features), pack_documents(DOCS, seq_len=8, padding_token_id=7)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(
    "docs, kwargs, match",
    [
        pytest.param([[1, 2, 3]], {"seq_len": 2}, r"docs\[0\]: expected at most seq_len = 2 tokens, got 3", id="long"),
        pytest.param([[1], []], {"seq_len": 2}, r"docs\[1\]: expected a non-empty 1-D", id="empty-doc"),
        pytest.param([[1.5]], {"seq_len": 2}, r"docs\[0\]: expected .* integer token ids, got torch.float", id="float"),
        pytest.param([[[1, 2]]], {"seq_len": 2}, r"docs\[0\]: expected .*1-D.*shape \(1, 2\)", id="2-d"),
        pytest.param([[1]], {"seq_len": 0}, r"seq_len: expected an int >= 1, got 0", id="seq-len-0"),
        pytest.param([[1], [2]], {"seq_len": 1, "rows": 1}, r"need 2 rows of 1 tokens, expected at most 1", id="rows"),
        pytest.param([[1]], {"seq_len": 2, "rows": 0}, r"rows: expected None or an int >= 1, got 0", id="rows-0"),
        pytest.param([[1]], {"seq_len": 2, "padding_token_id": 0.0}, r"padding_token_id: expected an int", id="pad"),
    ],
)
def test_pack_documents_errors(docs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack_documents(docs, **kwargs)


def test_causal_lm_loss_is_sum_over_targets_divided_by_the_count():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[3, -100, 4, 1, -100], [-100, -100, 2, 2, 9]])
    n = int((labels != -100).sum())
    expected = sum(
        -torch.log_softmax(logits[b, t], -1)[labels[b, t]] for b in range(2) for t in range(5) if labels[b, t] != -100
    ) / 10.0
    torch.testing.assert_close(causal_lm_loss(logits, labels, 10), expected, rtol=1e-14, atol=0)
    assert n == global_token_count(labels, None).item() == 6  # no mesh: this process's count
    half = causal_lm_loss(logits.detach().half(), labels, torch.tensor(n))
    assert half.dtype == torch.float32


def test_causal_lm_loss_with_no_target_is_zero_not_nan():
    logits = torch.randn(1, 3, 4, requires_grad=True)
    loss = causal_lm_loss(logits, torch.full((1, 3), -100), torch.tensor(0))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0


def test_causal_lm_loss_shape_error():
    expected = r"expected logits \[B, L, V\] and labels \[B, L\].*got logits \(2, 5, 3\) and labels \(2, 4\)"
    with pytest.raises(ValueError, match=expected):
        causal_lm_loss(torch.zeros(2, 5, 3), torch.zeros(2, 4, dtype=torch.long), 1)


def test_mesh_groups_rejects_other_objects():
    assert mesh_groups(None) == []
    with pytest.raises(ValueError, match="mesh: expected a DeviceMesh, a ProcessGroup or None, got str"):
        mesh_groups("cp")
