"""The step's documents for any mixer (blockdiag_dist.docs): boundaries of the padded stream, every rank's pieces
and where each piece's document continues from and into, checked rank by rank in one process against a brute
force walk over the positions, for contiguous, balanced and auto layouts, B > 1 and padding anywhere."""

from __future__ import annotations

import pytest
import torch

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.plan import plan_step
from blockdiag_ref import DocLayout

from test_dist_plan import random_ids


def brute_pieces(ids: torch.Tensor, world: int, layout: str):
    """Per rank: [(row, start, length, local_start, doc, prev_ranks, next_ranks)] by walking each rank's rows."""
    plan = plan_step(ids, world, layout)
    sh = plan.shards
    seg = torch.nn.functional.pad(DocLayout.from_doc_ids(ids).segment_ids, (0, sh.padded_len - ids.shape[1]))
    owner = {}
    for r in range(world):
        for p in sh.positions[r].tolist():
            owner[p] = r
    runs: dict[int, list[tuple[int, int, int]]] = {}  # doc -> [(rank, start, length)] in document order
    for b in range(ids.shape[0]):
        prev = None
        for p in range(sh.padded_len):
            d = int(seg[b, p]) - 1
            if d < 0:
                prev = None
                continue
            r = owner[p]
            if prev == (d, r):
                rank, start, n = runs[d][-1]
                runs[d][-1] = (rank, start, n + 1)
            else:
                runs.setdefault(d, []).append((r, p, 1))
            prev = (d, r)
    out: list[list[tuple]] = [[] for _ in range(world)]
    for d, chain in runs.items():
        ranks = [r for r, _, _ in chain]
        b = int(DocLayout.from_doc_ids(ids).segments[d, 0])
        for k, (r, start, n) in enumerate(chain):
            local = sh.positions[r].tolist().index(start)
            out[r].append((b, start, n, local, d, tuple(ranks[:k]), tuple(ranks[k + 1:])))
    return [sorted(o, key=lambda t: (t[0], t[3])) for o in out]


def brute_cu_seqlens(ids: torch.Tensor, padded_len: int) -> tuple[list[int], list[int]]:
    seg = torch.nn.functional.pad(DocLayout.from_doc_ids(ids).segment_ids, (0, padded_len - ids.shape[1]))
    bounds, docs = [], []
    for b in range(ids.shape[0]):
        for p in range(padded_len):
            s = int(seg[b, p])
            if p == 0 or s != int(seg[b, p - 1]):
                bounds.append(b * padded_len + p)
                docs.append(s - 1)
    return bounds + [ids.shape[0] * padded_len], docs


IDS = [
    pytest.param(torch.tensor([[1] * 13]), id="one-long"),
    pytest.param(torch.tensor([[1, 1, 2, 3, 3, 3, 4, 5, 5, 6, 6, 6, 6]]), id="many-short"),
    pytest.param(torch.tensor([[1, 1, 0, 0, 2, 2, 2, 0, 3, 3, 1]]), id="middle-padding"),
    pytest.param(torch.tensor([[1, 1, 1], [0, 2, 2]]), id="two-rows-S<8"),
    pytest.param(torch.tensor([[0, 0, 0, 0, 1, 1]]), id="leading-padding"),
    pytest.param(random_ids(3, 2, 37), id="random-B2-S37"),
    pytest.param(random_ids(4, 3, 23), id="random-B3-S23"),
    pytest.param(torch.tensor([[1] * 64]), id="one-doc-64"),
]


@pytest.mark.parametrize("ids", IDS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "balanced", "auto"])
def test_pieces_and_boundaries_match_brute_force(ids, world, layout):
    plan = plan_step(ids, world, layout)
    docs = plan.documents
    expected = brute_pieces(ids, world, layout)
    for r in range(world):
        got = [(p.row, p.start, p.length, p.local_start, p.doc, p.prev_ranks, p.next_ranks) for p in docs.pieces_of(r)]
        assert got == expected[r], f"rank {r}"
        for p in docs.pieces_of(r):
            assert p.continues_from == (p.start > p.doc_start) and p.continues_into == (p.end < p.doc_end)
            assert p.from_rank != r and p.into_rank != r  # the neighbours of a piece are on other ranks
    bounds, seg_docs = brute_cu_seqlens(ids, plan.shards.padded_len)
    assert docs.cu_seqlens.tolist() == bounds and docs.segment_doc.tolist() == seg_docs
    assert [p.index for p in docs.pieces] == list(range(len(docs.pieces)))
    keys = [(p.doc, p.start) for p in docs.pieces]
    assert keys == sorted(keys), "the piece table is in document order"
    assert sum(p.length for p in docs.pieces) == int((ids != 0).sum())


@pytest.mark.parametrize("layout", ["contiguous", "balanced", "auto"])
def test_rank_view_tensors(layout):
    ids = random_ids(5, 2, 31)
    world = 3
    plan = plan_step(ids, world, layout)
    seg = torch.nn.functional.pad(DocLayout.from_doc_ids(ids).segment_ids, (0, plan.shards.padded_len - 31))
    starts = torch.cat([torch.tensor([-1]), DocLayout.from_doc_ids(ids).segments[:, 1]])
    L = plan.shards.local_len
    for r in range(world):
        view = plan.documents.for_rank(r)
        pos = plan.shards.positions[r]
        s = seg[:, pos]  # [B, L]
        assert torch.equal(view.doc_index, s - 1)
        expected_pos = torch.where(s != 0, pos[None] - starts[s], -1)
        assert torch.equal(view.doc_position, expected_pos)
        # token_index lists every real local token once, pieces in local order, each piece consecutive
        flat_real = (s.flatten() != 0).nonzero().flatten()
        assert sorted(view.token_index.tolist()) == flat_real.tolist()
        for k, p in enumerate(view.pieces):
            lo, hi = view.cu_pieces_cpu[k].item(), view.cu_pieces_cpu[k + 1].item()
            assert view.token_index[lo:hi].tolist() == list(range(p.row * L + p.local_start, p.row * L + p.local_start + p.length))


def test_balanced_layout_gives_a_document_that_comes_back_to_a_rank():
    """One long document under balanced sharding: rank 0 holds its first and its last chunk."""
    ids = torch.ones(1, 16, dtype=torch.int64)
    docs = plan_step(ids, 2, "balanced").documents
    assert [(p.rank, p.start, p.length) for p in docs.pieces] == [(0, 0, 4), (1, 4, 8), (0, 12, 4)]
    last = docs.pieces[2]
    assert last.prev_ranks == (0, 1) and last.from_rank == 1 and not last.continues_into


def test_step_state_exposes_the_documents():
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 3]])
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(1, 7, 2), "_packed_seq_ids": ids})
    docs = ctx.state.docs
    assert docs is ctx.state.docs, "built once per step"
    assert docs.cu_seqlens_cpu.tolist() == [0, 3, 5, 6, 7] and docs.segment_doc.tolist() == [0, 1, -1, 2]
    assert [(p.doc, p.start, p.length) for p in docs.pieces] == [(0, 0, 3), (1, 3, 2), (2, 6, 1)]
    assert docs.doc_position.tolist() == [[0, 1, 2, 0, 1, -1, 0]]


def doc_cumsum_truth(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    seg = DocLayout.from_doc_ids(ids).segment_ids
    out = torch.zeros_like(x)
    for b in range(ids.shape[0]):
        run = torch.zeros(x.shape[-1], dtype=x.dtype)
        for p in range(ids.shape[1]):
            if seg[b, p] == 0:
                continue
            if p == 0 or seg[b, p] != seg[b, p - 1]:
                run = torch.zeros_like(run)
            run = run + x[b, p]
            out[b, p] = run
    return out


EXAMPLE_IDS = [
    pytest.param([[1] * 17 + [0] * 2 + [2] * 4 + [3], [4] * 3 + [0] + [5] * 20], id="B2-over-3-ranks"),
    pytest.param([[1] * 10 + [2] * 6 + [0] * 8], id="padding-rank"),
]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("ids", EXAMPLE_IDS)
def test_docs_example_mixer_at_cp3(session, layout, ids):
    """docs/hybrid.md's per-document cumsum, written from ``state.docs`` alone, at CP 3 (documents over 3 ranks,
    one coming back to a rank, padding, a rank holding only padding, B = 2): outputs and the input gradient equal
    the per-document truth."""
    import mixer_checks

    ids = torch.tensor(ids)
    per_rank = session.pool(3).run(mixer_checks.doc_cumsum_step, args=(ids.tolist(), layout), timeout=60, name="doc_cumsum")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*ids.shape, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(*ids.shape, 3, generator=g, dtype=torch.float64)
    truth = doc_cumsum_truth(ids, x)
    (truth * w).sum().backward()
    S = ids.shape[1]
    for r in per_rank:
        pos = torch.tensor(r["positions"])
        keep = pos < S
        torch.testing.assert_close(torch.from_numpy(r["y"])[:, keep], truth.detach()[:, pos[keep]], rtol=1e-12, atol=1e-12)
    dx = sum(torch.from_numpy(r["dx"]) for r in per_rank)
    torch.testing.assert_close(dx, x.grad, rtol=1e-12, atol=1e-12)
