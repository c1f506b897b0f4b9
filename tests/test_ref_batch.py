"""blockdiag_ref.doc_ids_from_batch: every input form, the seed's precedence, and every error."""

import pytest
import torch

from blockdiag_ref import DocLayout, doc_ids_from_4d_mask, doc_ids_from_batch

IDS = torch.tensor([[1, 1, 2, 2, 2, 0], [3, 3, 3, 0, 4, 4]])
B, S = IDS.shape


def canon(ids):
    """Doc ids renumbered as runs, so that equal layouts compare equal whatever their id values."""
    return DocLayout.from_doc_ids(ids).segment_ids


def additive(mask_bool, dtype=torch.float32, masked=float("-inf")):
    return torch.zeros(mask_bool.shape, dtype=dtype).masked_fill(~mask_bool, masked)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
def test_packed_seq_ids_win(dtype):
    batch = {"_packed_seq_ids": IDS.to(dtype), "attention_mask": torch.ones(B, S, dtype=torch.long)}
    got = doc_ids_from_batch(batch, S, B)
    assert got.dtype == torch.int64 and torch.equal(got, IDS)


def test_bool_packed_ids_are_one_document_per_run():
    got = doc_ids_from_batch({"_packed_seq_ids": torch.tensor([[True, True, False, True]])}, 4, 1)
    assert got.tolist() == [[1, 1, 0, 1]]


@pytest.mark.parametrize(
    "make_mask",
    [
        pytest.param(lambda m: m, id="bool"),
        pytest.param(lambda m: additive(m), id="additive-inf"),
        pytest.param(lambda m: additive(m, torch.float16, torch.finfo(torch.float16).min), id="additive-fp16-min"),
        pytest.param(lambda m: additive(m, torch.bfloat16, -1e9), id="additive-bf16-1e9"),
    ],
)
def test_multi_document_4d_mask_keeps_documents_apart(make_mask):
    mask = make_mask(DocLayout.from_doc_ids(IDS).materialize_mask())
    got = doc_ids_from_batch({"attention_mask": mask}, S, B)
    assert torch.equal(canon(got), canon(IDS))
    # the diagonal alone (the seed's reading) would merge documents 1 and 2 of row 0
    diagonal_only = mask.diagonal(dim1=2, dim2=3)[:, 0] if mask.dtype == torch.bool else None
    if diagonal_only is not None:
        assert not torch.equal(canon(diagonal_only.long()), canon(IDS))


def test_4d_mask_with_reused_ids_and_middle_padding():
    ids = torch.tensor([[1, 1, 0, 1, 2, 1, 1]])
    got = doc_ids_from_4d_mask(DocLayout.from_doc_ids(ids).materialize_mask())
    assert torch.equal(canon(got), canon(ids))


def test_4d_mask_padding_rows_are_not_read():
    mask = DocLayout.from_doc_ids(torch.tensor([[1, 1, 0]])).materialize_mask().clone()
    mask[0, 0, 2, :2] = True  # a padding row (diagonal False) may hold anything
    assert doc_ids_from_4d_mask(mask).tolist() == [[1, 1, 0]]


@pytest.mark.parametrize(
    "mask2d, expected",
    [
        pytest.param([[1, 1, 1, 0]], [[1, 1, 1, 0]], id="validity-int"),
        pytest.param([[True, True, False, False]], [[1, 1, 0, 0]], id="validity-bool"),
        pytest.param([[1, 1, 2, 0]], [[1, 1, 2, 0]], id="indexed"),
    ],
)
def test_2d_attention_mask(mask2d, expected):
    mask = torch.tensor(mask2d)
    assert doc_ids_from_batch({"attention_mask": mask}, 4, 1).tolist() == expected


def test_no_ids_no_mask_means_one_document_per_row():
    got = doc_ids_from_batch({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, 3, 2, device="cpu")
    assert got.tolist() == [[1, 1, 1], [1, 1, 1]]


def bad_block_causal():
    m = DocLayout.from_doc_ids(torch.tensor([[1, 1, 2, 2]])).materialize_mask().clone()
    m[0, 0, 2, 1] = True  # document 2's first query sees the end of document 1: not block-causal
    return m


def future_key():
    m = DocLayout.from_seqlens([3]).materialize_mask().clone()
    m[0, 0, 0, 2] = True
    return m


@pytest.mark.parametrize(
    "batch, match",
    [
        pytest.param({"_packed_seq_ids": torch.ones(B, S - 1, dtype=torch.long)}, r"expected shape \[B, S\] = \[2, 6\], got \[2, 5\]", id="ids-wrong-shape"),
        pytest.param({"_packed_seq_ids": torch.ones(B, S)}, "expected bool or integer ids, got dtype torch.float32", id="ids-float"),
        pytest.param({"_packed_seq_ids": -torch.ones(B, S, dtype=torch.long)}, "negative id", id="ids-negative"),
        pytest.param({"_packed_seq_ids": torch.ones(B, S, 1, dtype=torch.long)}, "expected 2 dims", id="ids-3d"),
        pytest.param({"attention_mask": torch.ones(B, 1, S, dtype=torch.bool)}, "expected 2 dims .* or 4 dims", id="mask-3d"),
        pytest.param({"attention_mask": torch.ones(B, 2, S, S, dtype=torch.bool)}, r"\[B, 1, S, S\]", id="mask-4d-heads"),
        pytest.param({"attention_mask": torch.ones(B, 1, S, S + 1, dtype=torch.bool)}, r"\[B, 1, S, S\]", id="mask-4d-not-square"),
        pytest.param({"attention_mask": torch.ones(B, 1, S, S, dtype=torch.long)}, "bool or additive float", id="mask-4d-int"),
        pytest.param({"attention_mask": torch.full((B, 1, S, S), -0.5)}, "got the value -0.5", id="mask-4d-additive-soft"),
        pytest.param({"attention_mask": torch.ones(B, 1, S, S, dtype=torch.bool)}, "block-causal", id="mask-4d-all-true"),
        pytest.param({"attention_mask": torch.ones(B, S)}, "bool or integer", id="mask-2d-float"),
        pytest.param({"attention_mask": torch.ones(B + 1, S, dtype=torch.long)}, r"\[B, S\] = \[2, 6\]", id="mask-2d-wrong-B"),
        pytest.param({"attention_mask": [[1] * S] * B}, "expected a torch.Tensor", id="mask-list"),
    ],
)
def test_batch_errors_name_expected_and_got(batch, match):
    with pytest.raises(ValueError, match=match):
        doc_ids_from_batch(batch, S, B)


@pytest.mark.parametrize(
    "mask, match",
    [
        pytest.param(bad_block_causal(), "block-causal.*row 0, query 2, key 0 = False", id="cross-document"),
        pytest.param(future_key(), "block-causal.*query 0, key 2", id="future-key"),
    ],
)
def test_4d_mask_must_be_block_causal(mask, match):
    with pytest.raises(ValueError, match=match):
        doc_ids_from_4d_mask(mask)


def test_layout_from_batch_equals_the_layout_of_the_batchs_doc_ids():
    """Every source of documents, and positions read in one pass where they name them alone (no doc-id tensor)."""
    from blockdiag_ref import layout_from_batch

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        B, S = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 30, (1,), generator=gen))
        ids = torch.repeat_interleave(torch.randint(0, 4, (B * S,), generator=gen),
                                      torch.randint(1, 6, (B * S,), generator=gen))[: B * S].view(B, S)
        pos = DocLayout.from_doc_ids(ids).doc_positions.clamp(min=0)  # restarts at 0; padding reads 0 too
        pos[:, 0] += trial % 2 * 5  # a row may start inside a document: its first token starts one all the same
        pos = pos.to((torch.int64, torch.int32, torch.int16)[trial % 3])
        batches = [{"position_ids": pos}, {"_packed_seq_ids": ids}, {"position_ids": pos, "attention_mask": (ids != 0).long()},
                   {"_packed_seq_ids": ids, "position_ids": pos}, {}]
        for batch in batches:
            got, want = layout_from_batch(batch, S, B), DocLayout.from_doc_ids(doc_ids_from_batch(batch, S, B))
            assert torch.equal(got.segments, want.segments) and (got.batch_size, got.seq_len) == (B, S)
            assert torch.equal(got.doc_ids, want.doc_ids)
        assert "doc_ids" not in layout_from_batch({"position_ids": pos}, S, B).__dict__


@pytest.mark.parametrize("positions", [torch.tensor([[0, 1, -3, 0, 1, 2]]), torch.tensor([[-1, 0, 1, 2, 3, 4]])])
def test_layout_from_batch_refuses_negative_positions_as_doc_ids_from_batch_does(positions):
    from blockdiag_ref import layout_from_batch

    for read in (layout_from_batch, doc_ids_from_batch):
        with pytest.raises(ValueError, match=f"expected positions >= 0, got {int(positions.min())}"):
            read({"position_ids": positions}, 6, 1)


def test_the_starts_are_found_alike_on_the_host_and_as_on_a_device():
    """layout_from_batch finds the starts (positions <= 0, and each row's first) by numpy on the host and by torch on
    a device (only the starts are copied back): both give the same indices and values (the torch path run on the
    CPU here)."""
    from blockdiag_ref.batch import _starts

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.int64, torch.int32, torch.int16):
        flat = torch.randint(-2, 4, (500,), generator=gen).to(dtype)
        host, device = _starts(flat, 50, on_host=True), _starts(flat, 50, on_host=False)
        assert (host[0] == device[0]).all() and (host[1] == device[1]).all()
        want = ((flat <= 0) | (torch.arange(500) % 50 == 0)).nonzero().flatten()
        assert host[0].tolist() == want.tolist() and host[1].tolist() == flat[want].tolist()


def test_a_flattening_collators_boundaries_name_the_documents_without_reading_the_tokens():
    """``cu_seq_lens_q`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) names one packed row's
    documents: the layout equals the one its positions give, for every dtype the boundaries come in, with no doc-id
    tensor built; the positions between a document's first and last token are not read (a restart there is the
    model's, as for flash-attn's varlen call given the same boundaries), and the boundaries win over them."""
    from transformers import DataCollatorWithFlattening

    from blockdiag_ref import layout_from_batch

    gen = torch.Generator().manual_seed(1)
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    for trial in range(100):
        lengths = torch.randint(1, 9, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
        batch = collate([{"input_ids": list(range(3, 3 + n))} for n in lengths])
        S = sum(lengths)
        cu = batch["cu_seq_lens_q"]
        for given in (cu, cu.long(), cu.tolist()):
            for keys in ({"cu_seq_lens_q": given}, {"cu_seq_lens_q": given, "cu_seq_lens_k": given,
                                                    "position_ids": batch["position_ids"]}):
                got = layout_from_batch(keys, S, 1)
                assert got.seqlens == [lengths] and "doc_ids" not in got.__dict__
                want = layout_from_batch({"position_ids": batch["position_ids"]}, S, 1)
                assert torch.equal(got.segments, want.segments)
                assert torch.equal(doc_ids_from_batch(keys, S, 1), want.doc_ids)
    pos = torch.tensor([[0, 1, 0, 3, 0, 1]])  # restarts inside the first document, between its edges
    assert layout_from_batch({"cu_seq_lens_q": [0, 4, 6], "position_ids": pos}, 6, 1).seqlens == [[4, 2]]
    assert layout_from_batch({"position_ids": pos}, 6, 1).seqlens == [[2, 2, 2]]
    # doc ids and a mask keep their precedence: the boundaries are not read
    ids = torch.tensor([[1, 1, 1, 2, 2, 2]])
    for keys in ({"_packed_seq_ids": ids}, {"attention_mask": ids}):
        assert layout_from_batch({**keys, "cu_seq_lens_q": [0, 6]}, 6, 1).seqlens == [[3, 3]]


@pytest.mark.parametrize("batch, B, match", [
    ({"cu_seq_lens_q": [0, 3, 5, 8]}, 1, r"cu_seq_lens_q: expected document boundaries rising strictly from 0 to S = 9 "
                                         r"\(one packed row\), got \[0, 3, 5, 8\]"),
    ({"cu_seq_lens_q": [0, 3, 3, 9]}, 1, r"rising strictly from 0 to S = 9 \(one packed row\), got \[0, 3, 3, 9\]"),
    ({"cu_seq_lens_q": [1, 9]}, 1, r"rising strictly from 0 to S = 9 \(one packed row\), got \[1, 9\]"),
    ({"cu_seq_lens_q": [0]}, 1, r"rising strictly from 0 to S = 9 \(one packed row\), got \[0\]"),
    ({"cu_seq_lens_q": torch.arange(40)}, 1, r"got \[0, 1, 2, 3, 4, 5, \.\.\. 28 more \.\.\., 34, 35, 36, 37, 38, 39\]"),
    ({"cu_seq_lens_q": torch.tensor([0.0, 9.0])}, 1, r"cu_seq_lens_q: expected 1-D integer boundaries \[n \+ 1\], got "
                                                      r"torch.float32 of shape \(2,\)"),
    ({"cu_seq_lens_q": "0,9"}, 1, r"cu_seq_lens_q: expected a 1-D integer tensor or a list of ints \[n \+ 1\], got str"),
    ({"cu_seq_lens_q": [0, 9]}, 2, r"cu_seq_lens_q: expected the boundaries of one packed row \(B = 1\), got B = 2"),
    ({"cu_seq_lens_q": [0, 4, 9], "cu_seq_lens_k": [0, 9]}, 1,
     r"cu_seq_lens_k: expected the boundaries of cu_seq_lens_q \[0, 4, 9\] \(self-attention over the packed row\), "
     r"got \[0, 9\]"),
    ({"cu_seq_lens_q": [0, 4, 9], "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8]])}, 1,
     r"position_ids: expected each document of cu_seq_lens_q to number its tokens from the row's first position 0 "
     r"\(>= 0\) on; got 4 at its first token, position 4 of document 1 \(tokens \[4, 9\)\) where 0 was expected"),
    ({"cu_seq_lens_q": [0, 4, 9], "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])}, 1,
     r"got 1 at its last token, position 8 of document 1 \(tokens \[4, 9\)\) where 4 was expected"),
    ({"cu_seq_lens_q": [0, 4, 9], "position_ids": torch.tensor([[-2, -1, 0, 1, -2, -1, 0, 1, 2]])}, 1,
     r"from the row's first position -2 \(>= 0\) on; got -2 at its first token, position 0 of document 0"),
    ({"cu_seq_lens_q": [0, 9], "position_ids": torch.zeros(1, 9)}, 1,
     r"position_ids: expected integer positions, got dtype torch.float32"),
])
def test_malformed_boundaries_are_refused_by_both_readers(batch, B, match):
    from blockdiag_ref import layout_from_batch

    for read in (layout_from_batch, doc_ids_from_batch):
        with pytest.raises(ValueError, match=match):
            read(batch, 9, B)
