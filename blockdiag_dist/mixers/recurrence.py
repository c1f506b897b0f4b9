"""Per-document context parallelism for any linear recurrence: the extension point of the recurrent mixers.

A recurrence per document::

    S_t = A_t S_{t-1} + B_t x_t          S = 0 before a document's first token

maps, on a rank's piece of a document (the positions ``[start, end)`` of it that the rank holds), the state
entering the piece to the state leaving it by an affine map ``S_out = M S_in + C``: the *transition* ``M``
(the product of the piece's ``A_t``) and the *contribution* ``C`` (the state the piece leaves from a zero state).
That pair is the piece's *summary*; its size is the state's, whatever the piece's length. A piece whose document
started earlier (on other ranks, or on this one before the document visited others) enters with the state
obtained by folding the summaries of the document's earlier pieces in document order:
``S = C_1``, then ``S = M_j S + C_j`` (the first piece's ``M`` is never needed: it enters with zero).

Per rank and call, with the plan below (a pure function of the doc ids and the sharding, identical on every
rank), in three local passes and one exchange:

1. **first pieces** (their document starts in them): the recurrence from zero, outputs and, for those whose
   document goes on, the leaving state (``C``);
2. **through pieces** (entering and leaving with a state): their summary ``(M, C)`` from zero;
3. **summary exchange**: each summary goes exactly to the ranks holding a later piece of its document
   (:func:`blockdiag_dist.exchange.exchange_summaries`, one ``all_to_all_single`` with sizes from the plan;
   skipped on every rank when no document crosses a rank), then each continuing piece's entering state is
   folded, in float32 or better (``state_dtype``);
4. **continuing pieces**: the recurrence from their entering state, outputs.

Autograd differentiates all of it; the exchange's backward sends each summary's gradient back to its owner
(the mirror image, no collective added to the forward). The output is tied to the received summaries (and, on
a rank holding only padding, to the inputs), so every rank runs the exchange's backward and every input gets a
gradient (zero on padding).

**Adding a recurrence** (Mamba2's SSD, Mamba1's selective scan, KDA, lightning attention, RG-LRU, ...): subclass
:class:`Recurrence`, say how a transition acts on a state (``transition``: ``"matrix"`` — ``M [.., K, K] @ S
[.., K, V]`` (delta rules, KDA); ``"diagonal"`` — ``M * S`` elementwise, ``M`` shaped like ``S`` (Mamba1, RG-LRU,
per-channel decays); ``"scalar"`` — one factor per head, ``M [H]`` (Mamba2's SSD, lightning attention)), and
implement :meth:`Recurrence.scan` (the recurrence over packed pieces, each from a given entering state, giving
outputs and leaving states) and, when ``M`` is cheaper than a scan of the identity, :meth:`Recurrence.summarize`.
Then :func:`run_recurrence` does the rest on every layout, B > 1, padding anywhere, documents over any number of
ranks, CP 1 included. :class:`blockdiag_dist.mixers.gated_delta.GatedDeltaRule` is the worked instance.

Shape legend: B rows, L rows of a rank, T = B * L local tokens, P pieces of a pass, ``*state`` a state's shape
per piece (e.g. ``[H, K, V]``), ``*out`` an output's shape per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..docs import DocPlan
from ..exchange.summary import exchange_summaries

__all__ = ["STATE_DTYPES", "Recurrence", "RecurrencePlan", "plan_recurrence", "run_recurrence"]

STATE_DTYPES = (torch.float32, torch.float64)  # summaries are exchanged and folded in float32 or better


@dataclass(frozen=True, eq=False)
class Subset:
    """Pieces of one pass: their positions in the rank's local piece list, their tokens packed piece after piece
    (``token_index``, local tokens ``b * L + l``, on the device) and the boundaries ``cu`` in that packing."""

    pieces: tuple[int, ...]
    token_index: Tensor
    cu: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.cu[-1]


@dataclass(frozen=True, eq=False)
class RecurrencePlan:
    """One rank's passes, routes and folds for every recurrent layer of a step (pure; see the module docstring).

    ``sends[d]`` / ``recvs[s]``: global piece ids (``Piece.index``) whose summary this rank sends to rank ``d``
    / receives from rank ``s``, in document order (rank ``s``'s ``sends[d]`` is rank ``d``'s ``recvs[s]``).
    ``with_transition``: summary pieces whose document started before them (their summary carries ``M``).
    ``folds[i]``: the global ids of the earlier pieces of continuing piece ``i``'s document, in document order.
    ``summary_source[g]``: for a local summary piece ``g``, the pass that computes it and its position there.
    """

    rank: int
    world: int
    pieces: tuple  # this rank's pieces (blockdiag_dist.docs.Piece), local order
    first: Subset
    through: Subset
    cont: Subset
    summary_source: dict[int, tuple[str, int]]
    sends: tuple[tuple[int, ...], ...]
    recvs: tuple[tuple[int, ...], ...]
    with_transition: frozenset[int]
    folds: tuple[tuple[int, ...], ...]
    any_traffic: bool  # some rank sends some summary in this step (the same on every rank)
    _metas: dict = field(default_factory=dict, repr=False)  # per-pass metadata of each recurrence (meta_key)

    def metas(self, rec: Recurrence, device: torch.device) -> dict:
        """:meth:`Recurrence.prepare` of each pass for ``rec``, built once per plan and recurrence kind."""
        key = (rec.meta_key(), str(device))
        got = self._metas.get(key)
        if got is None:
            got = self._metas.setdefault(key, {n: rec.prepare(getattr(self, n).cu, device) for n in ("first", "through", "cont")})
        return got

    def elements(self, ids: Sequence[int], state_numel: int, transition_numel: int) -> int:
        """Elements of the summaries of pieces ``ids``: ``C`` each, plus ``M`` where the piece carries one."""
        return sum(state_numel + (transition_numel if g in self.with_transition else 0) for g in ids)

    def send_splits(self, state_numel: int, transition_numel: int) -> list[int]:
        return [self.elements(ids, state_numel, transition_numel) for ids in self.sends]

    def recv_splits(self, state_numel: int, transition_numel: int) -> list[int]:
        return [self.elements(ids, state_numel, transition_numel) for ids in self.recvs]


def _subset(pieces, positions: list[int], L: int, device) -> Subset:
    tokens, cu = [], [0]
    for k in positions:
        p = pieces[k]
        tokens.append(torch.arange(p.local_start, p.local_start + p.length) + p.row * L)
        cu.append(cu[-1] + p.length)
    index = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.int64)
    return Subset(tuple(positions), index.to(device), tuple(cu))


def plan_recurrence(docs: DocPlan, rank: int, device: torch.device | str = "cpu") -> RecurrencePlan:
    """Rank ``rank``'s recurrence plan from the step's documents (pure; identical decisions on every rank)."""
    W, L = docs.world, docs.shards.local_len
    mine = docs.pieces_of(rank)
    first = [k for k, p in enumerate(mine) if not p.continues_from]
    through = [k for k, p in enumerate(mine) if p.continues_from and p.continues_into]
    cont = [k for k, p in enumerate(mine) if p.continues_from]
    source: dict[int, tuple[str, int]] = {}
    for j, k in enumerate(first):
        if mine[k].continues_into:
            source[mine[k].index] = ("first", j)
    for j, k in enumerate(through):
        source[mine[k].index] = ("through", j)

    by_doc: dict[int, list] = {}
    for p in docs.pieces:
        by_doc.setdefault(p.doc, []).append(p)
    routes: dict[tuple[int, int], list[int]] = {}  # (source rank, destination rank) -> piece ids, document order
    for chain in by_doc.values():
        for i, q in enumerate(chain):
            for d in sorted({p.rank for p in chain[i + 1:]} - {q.rank}):
                routes.setdefault((q.rank, d), []).append(q.index)
    sends = tuple(tuple(routes.get((rank, d), ())) for d in range(W))
    recvs = tuple(tuple(routes.get((s, rank), ())) for s in range(W))
    with_transition = frozenset(p.index for p in docs.pieces if p.continues_from and p.continues_into)
    folds = tuple(tuple(q.index for q in by_doc[mine[k].doc] if q.index < mine[k].index) for k in cont)
    return RecurrencePlan(
        rank=rank, world=W, pieces=mine, first=_subset(mine, first, L, device), through=_subset(mine, through, L, device),
        cont=_subset(mine, cont, L, device), summary_source=source, sends=sends, recvs=recvs,
        with_transition=with_transition, folds=folds, any_traffic=bool(routes),
    )


class Recurrence:
    """A linear recurrence per document, computed on packed pieces (see the module docstring).

    ``inputs`` are token-major tensors ``[T', ...]`` holding the tokens of the pieces of one pass, packed piece
    after piece; ``meta`` is what :meth:`prepare` made of the boundaries of that packing (cached per step).
    """

    transition: str = "matrix"  # "matrix" | "diagonal" | "scalar": how M acts on a state
    name: str = "recurrence"

    def prepare(self, cu: tuple[int, ...], device: torch.device) -> object:
        """Per-pass metadata for pieces with boundaries ``cu`` (e.g. a chunk layout); built once per step."""
        return cu

    def meta_key(self) -> tuple:
        """What :meth:`prepare`'s result depends on besides the boundaries (e.g. a chunk length)."""
        return (type(self).__name__,)

    def shapes(self, inputs: Sequence[Tensor]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(state shape, transition shape)`` of one piece, from the layer's inputs (their sizes, not their
        values: the same on every rank, one without pieces included)."""
        raise NotImplementedError

    def scan(self, inputs: Sequence[Tensor], meta: object, initial: Tensor | None, want_final: bool
             ) -> tuple[Tensor, Tensor | None]:
        """The recurrence over the pieces, piece ``i`` entering with ``initial[i]`` (None: zero):
        ``(outputs [T', *out], leaving states [P, *state] or None)``; with no piece, outputs ``[0, *out]``."""
        raise NotImplementedError

    def summarize(self, inputs: Sequence[Tensor], meta: object) -> tuple[Tensor, Tensor]:
        """``(M [P, *transition], C [P, *state])`` of each piece: its transition and its contribution from zero."""
        raise NotImplementedError

    def apply_transition(self, M: Tensor, S: Tensor) -> Tensor:
        """``M`` acting on one piece's state ``S [*state]``."""
        if self.transition == "matrix":
            return M @ S
        if self.transition == "diagonal":
            return M * S
        if self.transition == "scalar":
            return M.reshape(M.shape + (1,) * (S.dim() - M.dim())) * S
        raise ValueError(f"{type(self).__name__}.transition: expected 'matrix', 'diagonal' or 'scalar', got {self.transition!r}")


class _Tie(torch.autograd.Function):
    """``out`` unchanged; in backward, a zero gradient for every one of ``others`` too, so that the nodes
    producing them (the summary exchange; on a rank without pieces, the layer's inputs) run their backward on
    every rank, whatever this rank's output depends on.

    It saves ``out`` and reads it back in backward: under non-reentrant activation checkpointing, the recompute of
    a region (which repeats the region's collectives) starts at the first saved tensor backward unpacks, so the
    tie, the region's last node, starts it at the same point on every rank (a rank holding only padding saves
    nothing else, and would otherwise run the exchange's backward before, or without, the recompute)."""

    @staticmethod
    def forward(ctx, out, *others):
        ctx.others = [(t.shape, t.dtype, t.device) for t in others]
        ctx.save_for_backward(out)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018 - the unpack that starts a checkpoint's recompute here, on every rank
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.others))


def run_recurrence(
    rec: Recurrence,
    inputs: Sequence[Tensor],
    state,
    *,
    state_dtype: torch.dtype,
    plan: RecurrencePlan | None = None,
) -> Tensor:
    """Run ``rec`` per document over this rank's rows: ``inputs`` token-major ``[T, ...]`` (local order
    ``b * L + l``) -> outputs ``[T, *out]`` (0 on padding). ``state`` is the step state; ``plan`` defaults to
    the step's (:func:`plan_recurrence`, cached). Summaries are exchanged and folded in ``state_dtype``; the
    passes and the folds run with autocast off (in the inputs' dtype: a fold of transitions in bfloat16 is the
    low-precision chain this module exists to avoid)."""
    with torch.autocast(inputs[0].device.type, enabled=False):
        return _run(rec, inputs, state, state_dtype, plan)


def _run(rec: Recurrence, inputs: Sequence[Tensor], state, state_dtype: torch.dtype, plan: RecurrencePlan | None) -> Tensor:
    if plan is None:
        plan = state.mixer_plan(("recurrence",), lambda: plan_recurrence(state.plan.documents, state.rank, state.device))
    metas = plan.metas(rec, inputs[0].device)

    def pack(sub: Subset) -> list[Tensor]:
        return [t.index_select(0, sub.token_index) for t in inputs]

    mine = plan.pieces
    out_first, leaving = rec.scan(pack(plan.first), metas["first"], None,
                                  want_final=any(mine[k].continues_into for k in plan.first.pieces))
    summaries: dict[int, tuple[Tensor | None, Tensor]] = {}  # piece id -> (M or None, C), in state_dtype
    for g, (where, j) in plan.summary_source.items():
        if where == "first":
            summaries[g] = (None, leaving[j].to(state_dtype))
    if plan.through.pieces:
        M, C = rec.summarize(pack(plan.through), metas["through"])
        for j, k in enumerate(plan.through.pieces):
            summaries[mine[k].index] = (M[j].to(state_dtype), C[j].to(state_dtype))

    recv = None
    if plan.any_traffic and state.world > 1:
        state_shape, transition_shape = rec.shapes(inputs)
        cn, mn = _numel(state_shape), _numel(transition_shape)
        parts = [inputs[0].reshape(-1)[:0].to(state_dtype)]  # keeps an empty send in the autograd graph
        for ids in plan.sends:
            for g in ids:
                M, C = summaries[g]
                if g in plan.with_transition:
                    parts.append(M.reshape(-1))
                parts.append(C.reshape(-1))
        recv = exchange_summaries(torch.cat(parts), plan.send_splits(cn, mn), plan.recv_splits(cn, mn), state.group,
                                  state.mixer_traffic)
        at = 0
        for ids in plan.recvs:
            for g in ids:
                M = None
                if g in plan.with_transition:
                    M = recv[at:at + mn].view(transition_shape)
                    at += mn
                summaries[g] = (M, recv[at:at + cn].view(state_shape))
                at += cn

    after: dict[int, Tensor] = {}  # piece id -> the state leaving it, folded from its document's start (shared
    entering = []  # by the pieces of one document on this rank: each fold step is done once)
    for chain in plan.folds:
        S = None
        for i, g in enumerate(chain):
            if g not in after:
                M, C = summaries[g]
                after[g] = C if i == 0 else rec.apply_transition(M, S) + C
            S = after[g]
        entering.append(S)
    out_cont = None
    if plan.cont.pieces:
        initial = torch.stack(entering).to(inputs[0].dtype)
        out_cont, _ = rec.scan(pack(plan.cont), metas["cont"], initial, want_final=False)
    T = inputs[0].shape[0]
    out = out_first.new_zeros((T, *out_first.shape[1:])).index_copy(0, plan.first.token_index, out_first)
    if out_cont is not None:
        out = out.index_copy(0, plan.cont.token_index, out_cont)
    ties = ([] if recv is None else [recv]) + ([] if plan.pieces else list(inputs))  # no piece: nothing read them
    return _Tie.apply(out, *ties) if ties else out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
