"""The step's documents, for any sequence mixer: where each document lies in the padded stream, which pieces of
it each rank holds, and where each piece's document continues from and into.

A *piece* is a maximal run of consecutive positions of one document on one rank. Contiguous shards give a
rank at most one piece per document; balanced and auto layouts give several pieces per rank, not adjacent to
each other, and a document may come back to a rank after visiting others. Every decision a mixer takes from
here is a pure function of the replicated doc ids and the sharding, so every rank derives the same pieces,
the same routes and the same message sizes (collective safety), and a rank holding only padding has no piece
but still knows everyone else's.

Main entries: :func:`plan_documents` (all ranks, pure; ``StepPlan.documents``) and :class:`RankDocs`, one
rank's view with device tensors (``train_ctx.state.docs`` / ``blockdiag_dist.current_state().docs``).

Shape legend:
    B   batch rows                  Sp  padded length = W * L        L   rows held by one rank
    N   documents (all rows)        G   segments of the padded stream (documents and padding runs)
    P   pieces (all ranks)          Pr  pieces of one rank           T   real tokens of one rank

A *flat id* names one token of the padded batch: ``flat = b * Sp + p`` (row ``b``, global position ``p``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from .shard_plan import ShardPlan, padded_segments

__all__ = ["DocPlan", "Piece", "RankDocs", "plan_documents"]


@dataclass(frozen=True)
class Piece:
    """One rank's piece of one document: ``length`` consecutive positions from ``start`` in batch row ``row``,
    held on ``rank`` from its local row ``local_start`` on.

    ``prev_ranks`` / ``next_ranks``: the rank of every earlier / later piece of the same document, in document
    order (one entry per piece; a rank appears again when the document comes back to it). The piece right
    before this one is always on another rank (adjacent positions on one rank are one piece).
    """

    index: int  # position in the step's piece table (document order: by document, then start)
    rank: int
    doc: int  # document index, 0-based, row-major over the step (DocLayout's segment id - 1)
    row: int
    start: int  # global position of its first token
    length: int
    local_start: int  # local row (0 .. L-1) of its first token on its rank
    doc_start: int  # global positions of its document: [doc_start, doc_end)
    doc_end: int
    prev_ranks: tuple[int, ...] = ()
    next_ranks: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        """One past its last global position."""
        return self.start + self.length

    @property
    def offset(self) -> int:
        """Tokens of its document before it (its first token's position inside the document)."""
        return self.start - self.doc_start

    @property
    def continues_from(self) -> bool:
        """Whether its document started on an earlier piece (so a recurrence enters it with a state)."""
        return bool(self.prev_ranks)

    @property
    def continues_into(self) -> bool:
        """Whether its document goes on in a later piece (so the state leaving it is needed elsewhere)."""
        return bool(self.next_ranks)

    @property
    def from_rank(self) -> int | None:
        """The rank holding the piece right before it (None when its document starts here)."""
        return self.prev_ranks[-1] if self.prev_ranks else None

    @property
    def into_rank(self) -> int | None:
        """The rank holding the piece right after it (None when its document ends here)."""
        return self.next_ranks[0] if self.next_ranks else None


@dataclass(frozen=True, eq=False)
class DocPlan:
    """Documents and pieces of one step, for every rank (pure; identical on every rank).

    - ``cu_seqlens`` int64 ``[G + 1]``: boundaries of the segments of the padded stream ``[B * Sp]`` (rows
      flattened row-major, CP padding included): every document and every run of padding is one segment and
      every row starts one, so the segments tile the stream (the varlen vocabulary of flash-attn and
      flash-linear-attention, and NeMo Automodel's ``packed_cu_seqlens``);
    - ``segment_doc`` int64 ``[G]``: the document of each segment, -1 for padding;
    - ``doc_spans`` int64 ``[N, 3]``: ``(row, start, end)`` of each document, global positions;
    - ``pieces``: every rank's pieces, in document order; ``by_rank[r]``: indices of rank ``r``'s pieces in
      local order (by row, then local row).
    """

    shards: ShardPlan
    batch_size: int
    cu_seqlens: Tensor
    segment_doc: Tensor
    doc_spans: Tensor
    pieces: tuple[Piece, ...]
    by_rank: tuple[tuple[int, ...], ...]
    _rank_views: dict = field(default_factory=dict, repr=False)

    @property
    def world(self) -> int:
        return self.shards.world

    @property
    def num_docs(self) -> int:
        return self.doc_spans.shape[0]

    def pieces_of(self, rank: int) -> tuple[Piece, ...]:
        """Rank ``rank``'s pieces in local order."""
        return tuple(self.pieces[i] for i in self.by_rank[rank])

    def doc_pieces(self, doc: int) -> tuple[Piece, ...]:
        """The pieces of document ``doc``, in document order."""
        return tuple(p for p in self.pieces if p.doc == doc)

    def for_rank(self, rank: int, device: torch.device | str = "cpu") -> RankDocs:
        """Rank ``rank``'s view (cached per rank and device)."""
        key = (rank, str(device))
        view = self._rank_views.get(key)
        if view is None:
            view = self._rank_views.setdefault(key, RankDocs(self, rank, torch.device(device)))
        return view


def plan_documents(layout: DocLayout, shards: ShardPlan) -> DocPlan:
    """Documents and pieces of every rank for doc layout ``layout`` sharded by ``shards`` (pure).

    >>> from blockdiag_dist.plan import plan_shards
    >>> plan = plan_documents(DocLayout.from_seqlens([5, 2, 3]), plan_shards(10, 2))  # rank 0: 0..4, rank 1: 5..9
    >>> plan.cu_seqlens.tolist(), plan.segment_doc.tolist()
    ([0, 5, 7, 10], [0, 1, 2])
    >>> [(p.rank, p.doc, p.start, p.length, p.prev_ranks, p.next_ranks) for p in plan.pieces]
    [(0, 0, 0, 5, (), ()), (1, 1, 5, 2, (), ()), (1, 2, 7, 3, (), ())]
    >>> plan = plan_documents(DocLayout.from_seqlens([7, 3]), plan_shards(10, 2))  # document 0 crosses ranks
    >>> [(p.rank, p.doc, p.start, p.length, p.prev_ranks, p.next_ranks) for p in plan.pieces]
    [(0, 0, 0, 5, (), (1,)), (1, 0, 5, 2, (0,), ()), (1, 1, 7, 3, (), ())]
    """
    B, sp, W, L = layout.batch_size, shards.padded_len, shards.world, shards.local_len
    seg = padded_segments(layout, shards)  # [B, Sp], 0 = padding

    # segments of the flattened padded stream: a boundary wherever the segment id changes, and at every row start
    flat = seg.flatten()
    change = torch.ones(B * sp, dtype=torch.bool)
    change[1:] = flat[1:] != flat[:-1]
    change[torch.arange(B) * sp] = True
    starts = change.nonzero().flatten()
    cu_seqlens = torch.cat([starts, torch.tensor([B * sp])])
    segment_doc = flat[starts] - 1  # -1 = padding

    # pieces: runs of one segment over consecutive positions on one rank, found in local order (b, w, l)
    pos = shards.positions  # [W, L]
    s = seg[:, pos]  # [B, W, L]
    prev_s = torch.nn.functional.pad(s[..., :-1], (1, 0))
    prev_p = torch.nn.functional.pad(pos[:, :-1], (1, 0), value=-2)
    first = (s != 0) & ((s != prev_s) | (pos != prev_p + 1)[None])
    piece_of = torch.cumsum(first.flatten(), 0).view(B, W, L) - 1
    real = s != 0
    num = int(first.sum())
    lengths = torch.bincount(piece_of[real], minlength=num)
    b_idx, w_idx, l_idx = first.nonzero().unbind(1)  # [P] in (b, w, l) order = piece id order
    p_start = pos[w_idx, l_idx]
    p_doc = s[b_idx, w_idx, l_idx] - 1
    spans = layout.segments  # [N, 3] (row, start, end)
    d_start, d_end = spans[p_doc, 1], spans[p_doc, 2]

    order = torch.argsort(p_doc * sp + p_start)  # document order
    cols = [t[order].tolist() for t in (w_idx, p_doc, b_idx, p_start, lengths, l_idx, d_start, d_end)]
    rows = list(zip(*cols))
    ranks_of_doc: dict[int, list[int]] = {}
    for w, doc, *_ in rows:
        ranks_of_doc.setdefault(doc, []).append(w)
    pieces, seen = [], {}
    for i, (w, doc, b, start, n, l, ds, de) in enumerate(rows):
        k = seen.get(doc, 0)
        seen[doc] = k + 1
        chain = ranks_of_doc[doc]
        pieces.append(Piece(index=i, rank=w, doc=doc, row=b, start=start, length=n, local_start=l, doc_start=ds,
                            doc_end=de, prev_ranks=tuple(chain[:k]), next_ranks=tuple(chain[k + 1:])))
    by_rank: list[list[int]] = [[] for _ in range(W)]
    for p in sorted(pieces, key=lambda p: (p.rank, p.row, p.local_start)):
        by_rank[p.rank].append(p.index)
    return DocPlan(shards=shards, batch_size=B, cu_seqlens=cu_seqlens, segment_doc=segment_doc,
                   doc_spans=spans.clone(), pieces=tuple(pieces), by_rank=tuple(tuple(r) for r in by_rank))


class RankDocs:
    """One rank's view of the step's documents (``state.docs``): the global boundaries, this rank's pieces,
    and per-row tensors on the batch's device. Built once per step from the replicated plan (no communication).

    - ``cu_seqlens`` (device) / ``cu_seqlens_cpu`` int64 ``[G + 1]``, ``segment_doc`` ``[G]``, ``doc_spans``
      ``[N, 3]``: see :class:`DocPlan`;
    - ``pieces``: this rank's :class:`Piece` s, local order; ``plan``: every rank's (:class:`DocPlan`);
    - ``doc_index`` int64 ``[B, L]`` (device): the document of each local row, -1 on padding;
    - ``doc_position`` int64 ``[B, L]`` (device): each local row's position inside its document, -1 on padding;
    - ``token_index`` int64 ``[T]`` (device): the local token (``b * L + l``) of each real token, pieces
      concatenated in local order, and ``cu_pieces`` (device) / ``cu_pieces_cpu`` int64 ``[Pr + 1]``: their
      boundaries in that packed stream (what a varlen kernel over this rank's pieces takes).
    """

    def __init__(self, plan: DocPlan, rank: int, device: torch.device) -> None:
        if not 0 <= rank < plan.world:
            raise ValueError(f"rank: expected 0 <= rank < {plan.world}, got {rank}")
        self.plan = plan
        self.rank = rank
        self.device = device
        self.pieces: tuple[Piece, ...] = plan.pieces_of(rank)
        self.cu_seqlens_cpu: Tensor = plan.cu_seqlens
        self.segment_doc: Tensor = plan.segment_doc
        self.doc_spans: Tensor = plan.doc_spans
        L = plan.shards.local_len
        index = torch.full((plan.batch_size, L), -1, dtype=torch.int64)
        position = torch.full((plan.batch_size, L), -1, dtype=torch.int64)
        tokens, bounds = [], [0]
        for p in self.pieces:
            rows = torch.arange(p.local_start, p.local_start + p.length)
            index[p.row, rows] = p.doc
            position[p.row, rows] = torch.arange(p.offset, p.offset + p.length)
            tokens.append(p.row * L + rows)
            bounds.append(bounds[-1] + p.length)
        self.cu_pieces_cpu: Tensor = torch.tensor(bounds, dtype=torch.int64)
        self._token_index_cpu = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.int64)
        self.token_index: Tensor = self._token_index_cpu.to(device)
        self.cu_pieces: Tensor = self.cu_pieces_cpu.to(device)
        self.cu_seqlens: Tensor = plan.cu_seqlens.to(device)
        self.doc_index: Tensor = index.to(device)
        self.doc_position: Tensor = position.to(device)

    @property
    def world(self) -> int:
        return self.plan.world

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def local_len(self) -> int:
        return self.plan.shards.local_len

    @cached_property
    def continuing(self) -> tuple[Piece, ...]:
        """This rank's pieces whose document continues from or into another piece."""
        return tuple(p for p in self.pieces if p.continues_from or p.continues_into)

    def __repr__(self) -> str:
        return (f"RankDocs(rank={self.rank}/{self.world}, docs={self.plan.num_docs}, pieces={len(self.pieces)}, "
                f"continuing={len(self.continuing)})")
