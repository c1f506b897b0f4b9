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

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from blockdiag_ref import DocLayout

from .balance import overlaps, rows_outside
from .shard_plan import ShardPlan, interval_ranges

__all__ = ["DocPlan", "Piece", "RankDocs", "piece_table", "plan_documents"]


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


class DocPlan:
    """Documents and pieces of one step, for every rank (pure; identical on every rank).

    - ``cu_seqlens`` int64 ``[G + 1]``: boundaries of the segments of the padded stream ``[B * Sp]`` (rows
      flattened row-major, CP padding included): every document and every run of padding is one segment and
      every row starts one, so the segments tile the stream (the varlen vocabulary of flash-attn and
      flash-linear-attention, and NeMo Automodel's ``packed_cu_seqlens``);
    - ``segment_doc`` int64 ``[G]``: the document of each segment, -1 for padding;
    - ``doc_spans`` int64 ``[N, 3]``: ``(row, start, end)`` of each document, global positions;
    - ``table``: the pieces as columns of int64 ``[P]`` tensors (``rank``, ``doc``, ``row``, ``start``,
      ``length``, ``local_start``, ``doc_start``, ``doc_end``), in document order: the one source that the
      exchange plans, the kernels' pieces, the work per rank and the layout's cost derive from;
    - ``pieces``: every rank's :class:`Piece`, in document order (built when asked); ``by_rank[r]``: indices of
      rank ``r``'s pieces in local order (by row, then local row); ``pieces_of(r)`` builds rank ``r``'s only.

    Built from the documents' intervals and the shard's runs (``searchsorted``), ``O(N + B * R)`` for ``R`` shard
    runs: never a per-token tensor.
    """

    def __init__(self, shards: ShardPlan, batch_size: int, cu_seqlens: Tensor, segment_doc: Tensor, doc_spans: Tensor,
                 table: dict[str, Tensor]) -> None:
        self.shards, self.batch_size = shards, batch_size
        self.cu_seqlens, self.segment_doc, self.doc_spans = cu_seqlens, segment_doc, doc_spans
        self.table = table
        self._rank_views: dict = {}

    @property
    def world(self) -> int:
        return self.shards.world

    @property
    def num_docs(self) -> int:
        return self.doc_spans.shape[0]

    @property
    def num_pieces(self) -> int:
        return self.table["rank"].numel()

    @cached_property
    def _local_order(self) -> Tensor:
        """Piece indices sorted by (rank, row, local row)."""
        t, L = self.table, self.shards.local_len
        return torch.argsort((t["rank"] * self.batch_size + t["row"]) * L + t["local_start"])

    @cached_property
    def _rank_bounds(self) -> list[int]:
        ranks = self.table["rank"][self._local_order].contiguous()
        return torch.searchsorted(ranks, torch.arange(self.world + 1)).tolist()

    @cached_property
    def _chains(self) -> tuple[list[int], list[int]]:
        """(rank of every piece, first piece of every document and one past the last), in document order."""
        doc = self.table["doc"]
        first = torch.searchsorted(doc, torch.arange(self.num_docs + 1))
        return self.table["rank"].tolist(), first.tolist()

    def _piece(self, i: int, cols: dict[str, list[int]], j: int) -> Piece:
        ranks, first = self._chains
        d = cols["doc"][j]
        lo, hi = first[d], first[d + 1]
        return Piece(index=i, rank=cols["rank"][j], doc=d, row=cols["row"][j], start=cols["start"][j],
                     length=cols["length"][j], local_start=cols["local_start"][j], doc_start=cols["doc_start"][j],
                     doc_end=cols["doc_end"][j], prev_ranks=tuple(ranks[lo:i]), next_ranks=tuple(ranks[i + 1:hi]))

    def _pieces_at(self, index: Tensor) -> tuple[Piece, ...]:
        cols = {k: v[index].tolist() for k, v in self.table.items()}
        return tuple(self._piece(i, cols, j) for j, i in enumerate(index.tolist()))

    @cached_property
    def pieces(self) -> tuple[Piece, ...]:
        return self._pieces_at(torch.arange(self.num_pieces))

    @cached_property
    def by_rank(self) -> tuple[tuple[int, ...], ...]:
        order, b = self._local_order.tolist(), self._rank_bounds
        return tuple(tuple(order[b[r]:b[r + 1]]) for r in range(self.world))

    def rank_pieces(self, rank: int) -> Tensor:
        """int64: indices of rank ``rank``'s pieces in local order."""
        return self._local_order[self._rank_bounds[rank]:self._rank_bounds[rank + 1]]

    def pieces_of(self, rank: int) -> tuple[Piece, ...]:
        """Rank ``rank``'s pieces in local order."""
        if "pieces" in self.__dict__:
            return tuple(self.pieces[i] for i in self.rank_pieces(rank).tolist())
        return self._pieces_at(self.rank_pieces(rank))

    def kernel_pieces(self, rank: int) -> Tensor:
        """int64 ``[Pr, 4]``: rank ``rank``'s pieces in local order as ``(first local token b * L + l, length, flat
        id b * Sp + start of the first token, document start)``, what a varlen kernel plan takes."""
        t = {k: v[self.rank_pieces(rank)] for k, v in self.table.items()}
        L, sp = self.shards.local_len, self.shards.padded_len
        return torch.stack([t["row"] * L + t["local_start"], t["length"], t["row"] * sp + t["start"], t["doc_start"]], 1)

    def doc_pieces(self, doc: int) -> tuple[Piece, ...]:
        """The pieces of document ``doc``, in document order."""
        _, first = self._chains
        return self._pieces_at(torch.arange(first[doc], first[doc + 1]))

    def work_per_rank(self, window_left: int = -1) -> list[int]:
        """Attention (query, key) pairs of each rank's real queries, closed-form per piece: a query ``t``
        positions into its document sees ``min(t, left) + 1`` keys (``t + 1`` without a window)."""
        t = self.table
        offset = t["start"] - t["doc_start"]
        pairs = _keys_before(offset + t["length"], window_left) - _keys_before(offset, window_left)
        return torch.zeros(self.world, dtype=torch.int64).index_add_(0, t["rank"], pairs).tolist()

    def real_tokens_per_rank(self) -> list[int]:
        """Real (non-padding) tokens each rank holds, over all rows."""
        t = self.table
        return torch.zeros(self.world, dtype=torch.int64).index_add_(0, t["rank"], t["length"]).tolist()

    def cut_pieces_per_rank(self) -> list[int]:
        """Per rank: pieces whose document starts before them (its earlier part lives elsewhere)."""
        t = self.table
        cut = (t["start"] > t["doc_start"]).to(torch.int64)
        return torch.zeros(self.world, dtype=torch.int64).index_add_(0, t["rank"], cut).tolist()

    def for_rank(self, rank: int, device: torch.device | str = "cpu") -> RankDocs:
        """Rank ``rank``'s view (cached per rank and device)."""
        key = (rank, str(device))
        view = self._rank_views.get(key)
        if view is None:
            view = self._rank_views.setdefault(key, RankDocs(self, rank, torch.device(device)))
        return view


def _keys_before(t: Tensor, left: int) -> Tensor:
    """Keys seen by the first ``t`` queries of a document: ``sum_{i < t} (min(i, left) + 1)``."""
    if left < 0:
        return t * (t + 1) // 2
    w = left + 1
    return torch.where(t <= w, t * (t + 1) // 2, w * (w + 1) // 2 + (t - w) * w)


def piece_table(layout: DocLayout, shards: ShardPlan) -> dict[str, Tensor]:
    """The pieces of every rank as columns (see :class:`DocPlan`), in document order: each document ``[s, e)``
    of row ``b`` intersected with each shard run ``[a, a + n)`` it overlaps, found by ``searchsorted`` over the
    documents' flat starts and ends (``b * Sp + position``). Numpy over the documents and runs (a dozen calls
    on arrays of ``N`` and ``B * R``), torch columns out."""
    sp, B = shards.padded_len, layout.batch_size
    spans = layout.segments.numpy()
    d_row, d_start, d_end = spans[:, 0], spans[:, 1], spans[:, 2]
    f_start, f_end = d_row * sp + d_start, d_row * sp + d_end  # ascending
    runs = shards.runs.numpy()  # [R, 4] (rank, start, length, local_start)
    r_rank, r_start, r_len, r_local = (np.tile(runs[:, k], B) for k in range(4))
    r_row = np.repeat(np.arange(B, dtype=np.int64), runs.shape[0])
    x0 = r_row * sp + r_start
    run, doc, a, b = overlaps(x0, x0 + r_len, f_start, f_end)  # flat: every run against the documents it meets
    shift = r_row[run] * sp
    start, end = a - shift, b - shift
    order = np.argsort(doc * sp + start, kind="stable")  # (document, start): distinct for distinct pieces
    doc, run, start, end = doc[order], run[order], start[order], end[order]
    table = {"rank": r_rank[run], "doc": doc, "row": r_row[run], "start": start, "length": end - start,
             "local_start": r_local[run] + start - r_start[run], "doc_start": d_start[doc], "doc_end": d_end[doc]}
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)) for k, v in table.items()}


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
    B, sp = layout.batch_size, shards.padded_len
    spans = layout.segments  # [N, 3] (row, start, end)
    s = spans.numpy()
    f_start, f_end = s[:, 0] * sp + s[:, 1], s[:, 0] * sp + s[:, 2]
    # segments of the flattened padded stream: every document, every run of padding, a new one at every row start
    # (np.unique's sort of the whole, done by hand: the documents' bounds interleaved are already sorted, so
    # timsort merges two runs; 0.3 ms instead of 3 ms for 8,192 documents)
    cu_seqlens = np.concatenate([np.arange(B + 1, dtype=np.int64) * sp, np.stack([f_start, f_end], 1).ravel()])
    cu_seqlens.sort(kind="stable")
    cu_seqlens = cu_seqlens[np.concatenate([[True], cu_seqlens[1:] != cu_seqlens[:-1]])]
    if f_start.size:
        at = np.minimum(np.searchsorted(f_start, cu_seqlens[:-1]), f_start.size - 1)
        segment_doc = np.where(f_start[at] == cu_seqlens[:-1], at, -1)
    else:
        segment_doc = np.full(cu_seqlens.size - 1, -1, dtype=np.int64)
    return DocPlan(shards=shards, batch_size=B, cu_seqlens=torch.from_numpy(cu_seqlens),
                   segment_doc=torch.from_numpy(segment_doc.astype(np.int64, copy=False)), doc_spans=spans.clone(),
                   table=piece_table(layout, shards))


class RankDocs:
    """One rank's view of the step's documents (``state.docs``): the global boundaries, this rank's pieces,
    and per-row tensors on the batch's device. Built once per step from the replicated plan (no communication).

    - ``cu_seqlens`` (device) / ``cu_seqlens_cpu`` int64 ``[G + 1]``, ``segment_doc`` ``[G]``, ``doc_spans``
      ``[N, 3]``: see :class:`DocPlan`;
    - ``pieces``: this rank's :class:`Piece` s, local order (built on first use); ``plan``: every rank's
      (:class:`DocPlan`);
    - ``doc_index`` int64 ``[B, L]`` (device): the document of each local row, -1 on padding;
    - ``doc_position`` int64 ``[B, L]`` (device) / ``doc_position_cpu`` (host): each local row's position inside
      its document, -1 on padding;
    - ``token_index`` int64 ``[T]`` (device): the local token (``b * L + l``) of each real token, pieces
      concatenated in local order, and ``cu_pieces`` (device) / ``cu_pieces_cpu`` int64 ``[Pr + 1]``: their
      boundaries in that packed stream (what a varlen kernel over this rank's pieces takes).

    The per-row tensors (``doc_index``, ``doc_position``, ``token_index``: ``O(B * L)``) are built on first use,
    by the mixers and positions that read them; a step of attention alone never builds them.
    """

    def __init__(self, plan: DocPlan, rank: int, device: torch.device) -> None:
        if not 0 <= rank < plan.world:
            raise ValueError(f"rank: expected 0 <= rank < {plan.world}, got {rank}")
        self.plan = plan
        self.rank = rank
        self.device = device
        self.cu_seqlens_cpu: Tensor = plan.cu_seqlens
        self.segment_doc: Tensor = plan.segment_doc
        self.doc_spans: Tensor = plan.doc_spans
        mine = plan.rank_pieces(rank)
        self._table = {k: v[mine] for k, v in plan.table.items()}  # this rank's rows of the piece table
        self.cu_pieces_cpu: Tensor = torch.nn.functional.pad(torch.cumsum(self._table["length"], 0), (1, 0))
        self.cu_pieces: Tensor = self.cu_pieces_cpu.to(device)
        self.cu_seqlens: Tensor = plan.cu_seqlens.to(device)

    @cached_property
    def pieces(self) -> tuple[Piece, ...]:
        """This rank's :class:`Piece` s in local order (Python objects: built on first use, by the mixers that walk
        them)."""
        return self.plan.pieces_of(self.rank)

    # ---- per-row tensors, built on first use ------------------------------------------------------------
    @cached_property
    def _token_index_cpu(self) -> Tensor:
        t = self._table
        return interval_ranges(t["row"] * self.local_len + t["local_start"], t["length"])

    @cached_property
    def token_index(self) -> Tensor:
        return self._token_index_cpu.to(self.device)

    @cached_property
    def _rows_cpu(self) -> tuple[Tensor, Tensor]:
        """(document, position in it) of each local row, int64 ``[B, L]`` each, -1 on padding (host)."""
        t, tokens = self._table, self._token_index_cpu
        shape = (self.batch_size, self.local_len)
        index = torch.full((self.batch_size * self.local_len,), -1, dtype=torch.int64)
        position = torch.full_like(index, -1)
        index[tokens] = torch.repeat_interleave(t["doc"], t["length"])
        position[tokens] = interval_ranges(t["start"] - t["doc_start"], t["length"])
        return index.view(shape), position.view(shape)

    @cached_property
    def padding_mask(self) -> Tensor:
        """bool ``[B, L]`` on the device: True on the local rows that hold no document's token (the batch's
        padding and CP's), what ``doc_ids == 0`` of the full rows, padded with True and sharded, gives.
        Built on the device from the gaps between the pieces (``O(pieces)`` copied, not ``O(B * L)``), as the
        varlen kernel's padding rows are; a batch output, it leaves the documents' per-row tensors below unbuilt."""
        t, rows = self._table, self.batch_size * self.local_len
        mask = torch.zeros(rows, dtype=torch.bool, device=self.device)
        mask[rows_outside(t["row"] * self.local_len + t["local_start"], t["length"], rows, self.device)] = True
        return mask.view(self.batch_size, self.local_len)

    @cached_property
    def doc_index(self) -> Tensor:
        return self._rows_cpu[0].to(self.device)

    @cached_property
    def doc_position_cpu(self) -> Tensor:
        return self._rows_cpu[1]

    @cached_property
    def doc_position(self) -> Tensor:
        return self.doc_position_cpu.to(self.device)

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
