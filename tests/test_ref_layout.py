"""blockdiag_ref.DocLayout: documents, segments, varlen metadata and the materialized mask."""

import pytest
import torch

from blockdiag_ref import DocLayout, normalize_window


def brute_mask(doc_ids, left=-1):
    """Mask from the contract, one pair at a time: same run of one non-zero id, j <= i, i - left <= j."""
    B, S = doc_ids.shape
    out = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b in range(B):
        ids = doc_ids[b].tolist()
        for i in range(S):
            for j in range(i + 1):
                if ids[i] == 0 or (left >= 0 and i - j > left):
                    continue
                # same document iff every position between j and i carries the same non-zero id
                if all(ids[t] == ids[i] for t in range(j, i + 1)):
                    out[b, 0, i, j] = True
    return out


@pytest.mark.parametrize(
    "ids, seqlens",
    [
        pytest.param([[1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 0, 0, 0]], [[5, 2, 6]], id="design-picture"),
        pytest.param([[1, 1, 2, 1]], [[2, 1, 1]], id="reused-id"),
        pytest.param([[1, 0, 1]], [[1, 1]], id="padding-splits-a-run"),
        pytest.param([[0, 0, 7, 7, 0]], [[2]], id="leading-and-trailing-padding"),
        pytest.param([[0, 0, 0]], [[]], id="all-padding"),
        pytest.param([[4, 5, 6]], [[1, 1, 1]], id="single-token-docs"),
        pytest.param([[1, 1, 2], [3, 0, 3]], [[2, 1], [1, 1]], id="two-rows"),
    ],
)
def test_documents_are_maximal_runs(ids, seqlens):
    layout = DocLayout.from_doc_ids(torch.tensor(ids))
    assert layout.seqlens == seqlens
    assert torch.equal(layout.padding_mask, torch.tensor(ids) == 0)


def test_segment_ids_are_unique_across_rows():
    layout = DocLayout.from_doc_ids(torch.tensor([[1, 1, 2, 0], [1, 0, 1, 1]]))
    assert layout.segment_ids.tolist() == [[1, 1, 2, 0], [3, 0, 4, 4]]
    assert layout.segments.tolist() == [[0, 0, 2], [0, 2, 3], [1, 0, 1], [1, 2, 4]]


def test_varlen_metadata_matches_flash_attn_vocabulary():
    layout = DocLayout.from_seqlens([[3, 1], [2]], pad=[1, 0])
    assert layout.doc_ids.tolist() == [[1, 1, 1, 2, 0], [1, 1, 0, 0, 0]]
    assert layout.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert layout.cu_seqlens.dtype == torch.int32
    assert layout.unpad_indices.tolist() == [0, 1, 2, 3, 5, 6]
    assert layout.max_seqlen == 3
    assert layout.num_docs == 3


def test_from_seqlens_pads_shorter_rows():
    layout = DocLayout.from_seqlens([[2], [1, 1, 1]], pad=0)
    assert layout.doc_ids.tolist() == [[1, 1, 0], [1, 2, 3]]


def test_hand_computed_mask():
    # 1 1 2 0 1: query 4 is a new document (id 1 reused after padding) and sees only itself
    m = DocLayout.from_doc_ids(torch.tensor([[1, 1, 2, 0, 1]])).materialize_mask()[0, 0].int()
    assert m.tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 1],
    ]


def test_hand_computed_window_mask():
    m = DocLayout.from_seqlens([5]).materialize_mask(window_size=(1, 0))[0, 0].int()
    assert m.tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("left", [-1, 0, 2])
def test_mask_matches_brute_force_on_random_ids(seed, left):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3, (2, 13), generator=g)
    layout = DocLayout.from_doc_ids(ids)
    assert torch.equal(layout.materialize_mask(window_size=(left, 0)), brute_mask(ids, left))


def test_mask_on_selected_positions_is_a_submatrix():
    layout = DocLayout.from_seqlens([4, 3], pad=2)
    qp, kp = torch.tensor([3, 4, 8]), torch.tensor([0, 2, 4, 5])
    full = layout.materialize_mask()
    assert torch.equal(layout.materialize_mask(qp, kp), full[:, :, qp][:, :, :, kp])


@pytest.mark.parametrize(
    "make, match",
    [
        pytest.param(lambda: DocLayout.from_doc_ids([[1, 2]]), "expected a torch.Tensor", id="not-a-tensor"),
        pytest.param(lambda: DocLayout.from_doc_ids(torch.ones(3, dtype=torch.long)), "expected 2 dims", id="1-d"),
        pytest.param(lambda: DocLayout.from_doc_ids(torch.ones(1, 2, 3, dtype=torch.long)), "expected 2 dims", id="3-d"),
        pytest.param(lambda: DocLayout.from_doc_ids(torch.ones(1, 3)), "expected bool or integer ids, got dtype torch.float32", id="float"),
        pytest.param(lambda: DocLayout.from_doc_ids(torch.tensor([[1, -2]])), "expected ids >= 0.*got a negative id -2", id="negative"),
        pytest.param(lambda: DocLayout.from_doc_ids(torch.ones(1, 0, dtype=torch.long)), "expected B >= 1 and S >= 1", id="S=0"),
        pytest.param(lambda: DocLayout.from_seqlens([3, 0]), "expected document lengths >= 1", id="zero-length-doc"),
        pytest.param(lambda: DocLayout.from_seqlens([]), "expected at least one row", id="no-rows"),
        pytest.param(lambda: DocLayout.from_seqlens([[1], [2]], pad=[1]), "one value per row", id="pad-per-row-count"),
        pytest.param(lambda: DocLayout.from_seqlens([2], pad=-1), "padding count >= 0", id="negative-pad"),
        pytest.param(lambda: DocLayout.from_seqlens([[]]), "sequence length >= 1", id="empty-row"),
        pytest.param(lambda: DocLayout.from_seqlens([3]).materialize_mask(torch.tensor([3])), r"positions in \[0, 3\)", id="position-out-of-range"),
        pytest.param(lambda: DocLayout.from_segments(torch.tensor([[0, 0, 2]]), 1, 1), r"end <= 1.*got segment 0 = \[0, 0, 2\]", id="segment-past-the-row"),
        pytest.param(lambda: DocLayout.from_segments(torch.tensor([[0, 2, 2]]), 1, 4), "non-empty", id="empty-segment"),
        pytest.param(lambda: DocLayout.from_segments(torch.tensor([[0, 0, 3], [0, 2, 4]]), 1, 4), r"not overlapping; got segment 1 = \[0, 2, 4\] after \[0, 0, 3\]", id="overlapping-segments"),
        pytest.param(lambda: DocLayout.from_segments(torch.tensor([[1, 0, 1], [0, 0, 1]]), 2, 4), "row-major order", id="segments-out-of-order"),
        pytest.param(lambda: DocLayout.from_segments(torch.tensor([[2, 0, 1]]), 2, 4), "0 <= row < 2", id="segment-row-out-of-range"),
        pytest.param(lambda: DocLayout.from_segments(torch.tensor([0, 0, 1]), 1, 4), r"\[N, 3\]", id="segments-1-d"),
        pytest.param(lambda: DocLayout.from_segments(torch.zeros(0, 3, dtype=torch.long), 1, 0), "seq_len: expected an int >= 1", id="segments-S=0"),
    ],
)
def test_layout_errors_name_expected_and_got(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bool_and_int32_ids_are_accepted():
    for ids in (torch.tensor([[True, True, False]]), torch.tensor([[1, 1, 0]], dtype=torch.int32)):
        layout = DocLayout.from_doc_ids(ids)
        assert layout.doc_ids.dtype == torch.int64 and layout.seqlens == [[2]]


@pytest.mark.parametrize(
    "window, match",
    [
        pytest.param((2, 1), "right must be <= 0", id="right>0"),
        pytest.param((2,), "a pair", id="one-value"),
        pytest.param("2,0", "a pair", id="string"),
        pytest.param((2.0, 0), "pair of ints", id="float"),
    ],
)
def test_window_errors(window, match):
    with pytest.raises(ValueError, match=match):
        normalize_window(window)


def random_doc_ids(gen, B, S):
    """Runs of random ids 0..3 (reused ids and padding anywhere): every kind of document boundary."""
    lengths = torch.randint(1, 6, (B * S,), generator=gen)
    ids = torch.repeat_interleave(torch.randint(0, 4, (B * S,), generator=gen), lengths)[: B * S]
    return ids.view(B, S)


def test_a_layout_from_its_documents_equals_the_layout_from_its_ids():
    """from_segments and from_seqlens build no per-token tensor; what they build on first use equals what the
    scan of the ids gives, and so does every tensor derived from it."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        B, S = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
        scanned = DocLayout.from_doc_ids(random_doc_ids(gen, B, S))
        built = DocLayout.from_segments(scanned.segments, B, S)
        assert "doc_ids" not in built.__dict__ and "segment_ids" not in built.__dict__
        assert (built.batch_size, built.seq_len, built.num_docs) == (B, S, scanned.num_docs)
        assert torch.equal(built.segments, scanned.segments)
        assert torch.equal(DocLayout.from_doc_ids(built.doc_ids).segments, scanned.segments)
        for name in ("segment_ids", "padding_mask", "unpad_indices", "cu_seqlens", "doc_starts", "doc_positions"):
            assert torch.equal(getattr(built, name), getattr(scanned, name)), name
        assert built.seqlens == scanned.seqlens
        pads = [S - sum(row) for row in scanned.seqlens]
        packed = DocLayout.from_seqlens(scanned.seqlens, pad=pads)  # each row's documents packed from its start
        ids = torch.zeros(B, S, dtype=torch.long)
        for b, row in enumerate(scanned.seqlens):  # the per-row construction from_seqlens replaced
            ids[b, : sum(row)] = torch.repeat_interleave(torch.arange(1, len(row) + 1), torch.tensor(row, dtype=torch.long))
        assert torch.equal(packed.doc_ids, ids)
        assert torch.equal(packed.segments, DocLayout.from_doc_ids(ids).segments)
