"""The per-step state: plans and kernel metadata computed once in the batch function, activated by
``train_ctx()``, read by every ``cp_blockdiag_sdpa`` call of the step.

The active state lives in a process-wide stack, not in a ``ContextVar`` or thread-local: autograd runs
backward (and the recompute of activation checkpointing) on its own worker threads, which must see the same
state as the forward did.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor

from . import guard as _guard
from .bidirectional import BlockPlan, exchange_plan, plan_blocks
from .docs import RankDocs
from .exchange import TrafficLog, a2a_kv, allgather_kv, halo_kv
from .exchange.allgather import all_gather_tensor
from .kernels.dense import DenseMeta, plan_dense
from .kernels.varlen import VarlenMeta, plan_varlen_pieces
from .plan import ExchangePlan, StepPlan
from .shard_plan import FlatIndex, interval_ranges

__all__ = [
    "AttentionNotRoutedError",
    "DecoderEntryNotShardedError",
    "PlanMismatchError",
    "StepState",
    "WindowPlan",
    "activate",
    "current_state",
]

log = logging.getLogger("blockdiag_dist")


class PlanMismatchError(RuntimeError):
    """Ranks of one CP group derived different plans (they were given different batches or options)."""


class AttentionNotRoutedError(RuntimeError):
    """A step's context exited without any attention call reaching ``cp_blockdiag_sdpa``."""


class DecoderEntryNotShardedError(RuntimeError):
    """A step built with ``shard_primary=False`` exited without the model's decoder entry being sharded."""


@dataclass(frozen=True, eq=False)
class WindowPlan:
    """What this rank does for one window: the exchange, its transport sizes, and the kernel metadata."""

    window_left: int
    chunk: int  # chunked local attention's chunk length; -1 = none
    exchange: ExchangePlan
    mode: str  # "local" | "allgather" | "halo" | "a2a"
    reason: str
    key_index: FlatIndex  # the key buffer's rows by flat id (host), from its runs
    send_runs: tuple[Tensor, Tensor] | None  # halo / a2a: the rows sent as runs (first local index, length), host
    send_splits: list[int]
    recv_splits: list[int]
    kernel_meta: DenseMeta | VarlenMeta  # on the device
    device: torch.device

    @cached_property
    def key_flat_ids(self) -> Tensor:
        """int64 ``[Tk]`` (host): the flat id held by each row of the key buffer (token-level; built when asked)."""
        return self.key_index.flat_ids()

    @cached_property
    def send_rows(self) -> Tensor | None:
        """int64 ``[sum(send_splits)]`` on the device: the local rows this rank sends (halo / a2a), grouped by
        destination; None for the other exchanges. Token-level, so built from :attr:`send_runs` on the device by the
        first exchange that sends, never by the batch function."""
        if self.send_runs is None:
            return None
        starts, lengths = (t.to(self.device) for t in self.send_runs)
        return interval_ranges(starts, lengths, total=sum(self.send_splits))


class StepState:
    """Everything one rank needs for one step. Built by ``make_cp_blockdiag_batch_and_ctx``."""

    def __init__(
        self,
        plan: StepPlan,
        *,
        rank: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        kv_exchange: str,
        kernel: str,
        check_consensus: bool = True,
        expect_attention: bool = True,
        shard_primary: bool = True,
        padding_token_id: int = 0,
        shard_vision: bool = False,
    ) -> None:
        self.plan = plan
        self.rank = rank
        self.world = plan.shards.world
        self.group = group
        self.device = device
        self.kv_exchange = kv_exchange  # requested: auto | allgather | halo | a2a
        self.kernel = "varlen" if kernel == "auto" else kernel
        self.check_consensus = check_consensus
        self.expect_attention = expect_attention
        self.attention_calls = 0  # calls of cp_blockdiag_sdpa that computed under this step
        # what those calls computed: (window left, chunk length, with sinks, softcap), -1 = none (for reports)
        self.attention_kinds: set[tuple[int, int, bool, float | None]] = set()
        self.shard_primary = shard_primary  # False: the model's inputs stay full, sharded at its decoder's entry
        self.padding_token_id = padding_token_id
        self.shard_vision = shard_vision  # vision towers run on this rank's share of the images (integrations)
        self.decoder_entries = 0  # decoder entries sharded in this step (shard_primary=False)
        self.traffic = TrafficLog()
        self.mixer_traffic = TrafficLog()  # what the mixers' exchanges moved: convolution histories, state summaries
        self.mixer_widths: frozenset[int] | None = None  # convolution widths planned in the batch function (None: any)
        self.notes: list[str] = []  # fallbacks and substitutions that happened, with their reasons
        # by (window left, chunk, bidirectional, whole blocks)
        self._windows: dict[tuple[int, int, bool, bool], WindowPlan] = {}
        self._agreed: set[tuple[int, int, bool, bool]] = set()  # windows whose plan the CP group compared (check_consensus)
        self.blocks: BlockPlan | None = None  # the step's bidirectional blocks (set_bidirectional_blocks)
        self.block_entries = 0  # entries of a model whose blocks come from its token_type_ids (integrations.vlm)
        self._mixer_plans: dict = {}  # plans of the sequence mixers (blockdiag_dist.mixers), built on first use
        self._mixers_agreed: set[str] = set()  # mixer call signatures the CP group compared (check_consensus)
        self._lock = threading.RLock()
        self.guard = _guard.StepGuard(plan.shards.local_len, self.note)  # refuses layers not computed per document

    # ---- shapes ---------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.plan.layout.batch_size

    @property
    def seq_len(self) -> int:
        """``S``: the length of the rows as given to the batch function."""
        return self.plan.shards.seq_len

    @property
    def local_len(self) -> int:
        return self.plan.shards.local_len

    @property
    def positions(self) -> Tensor:
        """int64 ``[L]``: global positions of this rank's rows (``>= seq_len`` = CP padding)."""
        return self.plan.shards.rank_positions(self.rank)

    @property
    def docs(self) -> RankDocs:
        """The step's documents as this rank sees them, for any sequence mixer: global boundaries, this rank's
        pieces and where each continues from and into (:class:`blockdiag_dist.docs.RankDocs`)."""
        return self.plan.documents.for_rank(self.rank, self.device)

    # ---- notes ----------------------------------------------------------------------------------------
    def note(self, message: str) -> None:
        """Record a fallback or substitution once per step (and log the first of its kind once per process)."""
        with self._lock:
            if message not in self.notes:
                self.notes.append(message)
                _log_once(message)

    def _no_attention_hint(self) -> str:
        """For a step whose sequence mixers the guard saw computed per document: what a model without any
        softmax attention passes (safe: the guard still refuses every layer not computed per document)."""
        mixers = self.guard.per_document
        if not mixers:
            return ""
        return (f" This step computed its sequence mixers per document ({', '.join(mixers)}): if the model has no "
                "softmax attention at all (a pure state-space model), build the step with expect_attention=False; "
                "every layer not computed per document is still refused.")

    def check_attention_seen(self) -> None:
        """Raise when the step expects attention and none reached ``cp_blockdiag_sdpa`` (checked at context exit)."""
        if self.expect_attention and self.attention_calls == 0:
            raise AttentionNotRoutedError(
                "train_ctx(): the step's context exited without any attention call reaching cp_blockdiag_sdpa; "
                "expected at least one. The batch is sharded, so attention that bypasses it (attn_implementation "
                "'eager' / 'sdpa' / 'flash_attention_2', a model whose attention does not use transformers' "
                "attention interface, or a module that bound scaled_dot_product_attention by name before "
                "sdpa_routing()) attends only within this rank's shard, across document ends: this step's "
                "gradients are wrong. Route every attention call through cp_blockdiag_sdpa (sdpa_routing(), "
                "register_transformers_attention())." + self._no_attention_hint()
            )
        if not self.shard_primary and self.decoder_entries == 0:
            raise DecoderEntryNotShardedError(
                "train_ctx(): the step was built with shard_primary=False (the model's inputs stay full, to be "
                "sharded at its decoder's entry) and exited without any decoder entry being sharded; expected the "
                "model's language model to be entered at least once. The integration shards the entry of a "
                "transformers vision-language model's language_model (blockdiag_dist.integrations.vlm); for any "
                "other model keep shard_primary=True (the batch function shards every sequence-aligned tensor)."
            )

    # ---- bidirectional blocks ---------------------------------------------------------------------------
    def set_bidirectional_blocks(self, bidirectional_blocks: Tensor) -> None:
        """Give the step its bidirectional blocks: int ``[B, S]`` block ids of the full rows (0 = none; the same on
        every rank), read by calls with ``cp_blockdiag_sdpa(..., bidirectional_blocks=True)``. Planned here, on
        the host, once (:func:`blockdiag_dist.bidirectional.plan_blocks`); giving different blocks twice in one
        step raises ``ValueError``."""
        B, S = self.batch_size, self.seq_len
        if not isinstance(bidirectional_blocks, Tensor) or tuple(bidirectional_blocks.shape) != (B, S):
            got = tuple(bidirectional_blocks.shape) if isinstance(bidirectional_blocks, Tensor) else type(bidirectional_blocks).__name__
            raise ValueError(f"bidirectional_blocks: expected block ids of the full rows [B, S] = [{B}, {S}] "
                             f"(as given to the batch function), got {got}")
        blocks = plan_blocks(self.plan.layout, self.plan.shards, self.plan.documents, bidirectional_blocks)
        with self._lock:
            if self.blocks is not None and self.blocks.digest != blocks.digest:
                raise ValueError("bidirectional_blocks: expected one set of blocks per step, got a second, different "
                                 "one (every attention call of a step sees the same blocks)")
            self.blocks = blocks

    # ---- per-window plans -----------------------------------------------------------------------------
    def window_plan(self, window_left: int, chunk: int = -1, bidirectional: bool = False,
                    whole_blocks: bool = False) -> WindowPlan:
        """The plan for a window (and chunk length of chunked local attention, ``-1`` = none; whether the step's
        bidirectional blocks apply, and whether a query sees its whole block beyond the window), built on first use
        in the step (then cached; thread-safe). Never communicates: every decision in it derives from the replicated
        doc ids, so one rank may call it alone (reports)."""
        whole_blocks = bool(bidirectional and whole_blocks)
        key = (window_left, chunk, bidirectional, whole_blocks)
        wp = self._windows.get(key)
        if wp is None:
            with self._lock:
                wp = self._windows.get(key)
                if wp is None:
                    wp = self._build_window_plan(window_left, chunk, bidirectional, whole_blocks)
                    self._windows[key] = wp
        return wp

    def agreed_window_plan(self, window_left: int, chunk: int = -1, bidirectional: bool = False,
                           whole_blocks: bool = False) -> WindowPlan:
        """:meth:`window_plan`, compared across the CP group on the window's first use in the step when
        ``check_consensus`` (one all-reduce of a fingerprint; every rank calls it at the same point)."""
        whole_blocks = bool(bidirectional and whole_blocks)
        key = (window_left, chunk, bidirectional, whole_blocks)
        wp = self.window_plan(*key)
        if self.check_consensus and key not in self._agreed:  # every call of a step's attention passes here
            self.agree_windows([key])
        return wp

    def agree_windows(self, keys: Sequence[tuple[int, int, bool, bool]]) -> None:
        """Plan every window of ``keys`` (``(window_left, chunk, bidirectional, whole_blocks)``, as
        :meth:`window_plan` takes them) and, when ``check_consensus``, compare those not compared yet across the
        CP group in one all-reduce of one fingerprint (the batch function agrees all its windows at once; every
        rank calls it at the same point with the same keys)."""
        plans = {key: self.window_plan(*key) for key in keys}
        if not self.check_consensus or all(key in self._agreed for key in plans):
            return
        with self._lock:
            todo = [key for key in plans if key not in self._agreed]
            if todo:
                self._check_consensus([(key, plans[key].mode) for key in todo])
                self._agreed.update(todo)

    def _build_window_plan(self, window_left: int, chunk: int = -1, bidirectional: bool = False,
                           whole_blocks: bool = False) -> WindowPlan:
        plan = self.plan.chunked(chunk)  # chunked attention: the chunks are the documents
        xplan = plan.exchange(window_left)
        blocks = self.blocks if bidirectional else None
        if bidirectional:
            if blocks is None:
                raise ValueError("bidirectional_blocks=True: expected the step's blocks (given to the batch function "
                                 "or StepState.set_bidirectional_blocks), got none")
            if chunk > 0:
                raise ValueError(f"bidirectional_blocks: expected no chunked attention with them, got chunk_size={chunk}")
            xplan = exchange_plan(plan, window_left, blocks, whole_blocks)
        mode, reason = choose_exchange(xplan, self.kv_exchange)
        send_runs, send_splits, recv_splits = None, [], []
        B, L, sp = self.batch_size, self.local_len, self.plan.shards.padded_len
        shards = self.plan.shards
        if mode == "allgather":  # the buffer is (rank, row, local row): every rank's runs, row after row
            runs = shards.runs
            rows = torch.arange(B).repeat(runs.shape[0])
            run = torch.arange(runs.shape[0]).repeat_interleave(B)
            key_index = FlatIndex.from_runs(rows * sp + runs[run, 1], runs[run, 2],
                                            runs[run, 0] * (B * L) + rows * L + runs[run, 3], space=B * sp)
        else:  # this rank's rows, then what it receives (by source rank, then flat id)
            mine = shards.rank_runs(self.rank)
            rows = torch.arange(B).repeat_interleave(mine.shape[0])
            starts, lengths = [rows * sp + mine[:, 1].repeat(B)], [mine[:, 2].repeat(B)]
            if mode != "local":
                got = xplan.spans_to(self.rank)
                got = got[torch.sort(got[:, 1], stable=True).indices]
                starts.append(got[:, 2] * sp + got[:, 3])
                lengths.append(got[:, 4])
                send_runs = xplan.send_runs(self.rank)  # halo: all of them go to rank + 1
                if mode == "a2a":
                    send_splits = xplan.send_counts(self.rank)
                    recv_splits = xplan.recv_counts(self.rank)
                else:  # halo
                    send_splits = [int(send_runs[1].sum())]
                    recv_splits = [xplan.recv_counts(self.rank)[self.rank - 1] if self.rank > 0 else 0]
            key_index = FlatIndex.from_runs(torch.cat(starts), torch.cat(lengths), space=B * sp)
        labels = None if blocks is None else blocks.labels
        if self.kernel == "dense":  # token-level by design: the dense kernel's mask is [Tq, Tk]
            meta = plan_dense(self.plan.local_flat_ids(self.rank), key_index.flat_ids(), plan.segments, sp, window_left,
                              labels, whole_blocks)
        else:  # this rank's pieces, from the step's piece table: no per-token tensor of the whole batch
            mine = plan.documents.rank_pieces(self.rank)
            key_end = None if blocks is None else blocks.piece_key_end[mine]
            block_start = blocks.piece_block_start[mine] if whole_blocks else None
            meta = plan_varlen_pieces(plan.documents.kernel_pieces(self.rank), B * L, key_index, sp, window_left,
                                      key_end=key_end, labels=labels, block_start=block_start)
        decision = f"kv_exchange={mode} (window left={window_left}{_chunk_text(chunk)})"  # once per window and mode
        _log_once(f"{decision}: {reason}", kind=f"{decision}: {_NUMBER.sub('#', reason)}")
        return WindowPlan(
            window_left=window_left,
            chunk=chunk,
            exchange=xplan,
            mode=mode,
            reason=reason,
            key_index=key_index,
            send_runs=send_runs,
            send_splits=send_splits,
            recv_splits=recv_splits,
            kernel_meta=meta.to(self.device),
            device=self.device,
        )

    # ---- mixers' plans ----------------------------------------------------------------------------------
    def mixer_plan(self, key: tuple, build):
        """The plan of a sequence mixer under ``key``, built by ``build()`` on first use in the step (then cached;
        thread-safe). Like :meth:`window_plan`, a pure function of the replicated plan: never communicates."""
        plan = self._mixer_plans.get(key)
        if plan is None:
            with self._lock:
                plan = self._mixer_plans.get(key)
                if plan is None:
                    plan = self._mixer_plans[key] = build()
        return plan

    def agree_mixer(self, signature: str) -> None:
        """On the first call of a mixer with this ``signature`` (its kind, shapes, dtypes, options) in the step,
        compare it across the CP group when ``check_consensus`` (one small all-reduce; every rank calls it at the
        same point): ranks that disagree would size their exchanges differently. Raises
        :class:`PlanMismatchError` on every rank, naming each rank's signature."""
        if not self.check_consensus or signature in self._mixers_agreed:
            return
        with self._lock:
            if signature in self._mixers_agreed:
                return
            self._compare_fingerprints(f"mixer {signature}", lambda: signature)
            self._mixers_agreed.add(signature)

    def _check_consensus(self, windows: Sequence[tuple[tuple[int, int, bool, bool], str]]) -> None:
        """All-gather one fingerprint of the plan and of ``windows`` (each ``(key, mode)``); raise naming the ranks
        that disagree (instead of hanging)."""
        extra = ""
        for (window_left, chunk, bidirectional, whole_blocks), mode in windows:
            blocks = (self.blocks.digest.hex() + ("|whole" if whole_blocks else "")) if bidirectional else ""
            extra += f"|{window_left}|{chunk}|{mode}|{self.kernel}|{blocks}"
        what = ", ".join(f"left={key[0]}{_chunk_text(key[1])}" for key, _ in windows)
        self._compare_fingerprints(f"window{'s' if len(windows) > 1 else ''} {what}", None, extra)

    def _compare_fingerprints(self, what: str, readable, extra: str = "") -> None:
        """Compare a fingerprint ``h`` of the plan and ``what`` (+ ``extra``) across the group in one all-reduce
        (MAX) of ``[h, ~h]``: every rank holds the same ``h`` exactly when ``max(h) == ~max(~h) = min(h)``. Under
        gloo a small all-reduce costs a fraction of an all-gather (4 ranks on 2 cores: 0.6 ms of CPU per rank
        against 1.8 ms for the 8-byte fingerprints; 8 ranks: 0.9 against 3.1 ms). On a mismatch, which every rank
        sees, every rank all-gathers the fingerprints and raises naming the disagreeing ranks and, when
        ``readable`` is given, what each has (a second all-gather)."""
        if self.group is None or self.world == 1:
            return
        h = hashlib.sha256(self.plan.fingerprint())
        h.update(f"|{what}{extra}".encode())
        mine = int.from_bytes(h.digest()[:8], "little", signed=True)
        extremes = torch.tensor([mine, ~mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
        high, low = extremes.tolist()
        if high != ~low:
            tensor = torch.tensor([mine], dtype=torch.int64, device=self.device)
            gathered = torch.empty(self.world, dtype=torch.int64, device=self.device)
            all_gather_tensor(gathered, tensor, group=self.group)
            values = gathered.tolist()
            by_value: dict[int, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(v, []).append(r)
            groups = "; ".join(f"ranks {ranks} have {v & 0xFFFFFFFF:08x}" for v, ranks in by_value.items())
            if readable is not None:
                texts: list = [None] * self.world
                dist.all_gather_object(texts, readable(), group=self.group)
                groups += " (" + "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts)) + ")"
            raise PlanMismatchError(
                f"CP plan consensus failed ({what.split(' ', 1)[0] if readable else what}): expected one plan "
                f"fingerprint on all {self.world} ranks, got {groups}. The ranks were given different doc ids, "
                "sizes or options."
            )

    # ---- the exchange ---------------------------------------------------------------------------------
    def exchange(self, kv_tok: Tensor, wp: WindowPlan) -> Tensor:
        """Deliver the key buffer ``[Tk, F]`` for packed local K/V tokens ``kv_tok [B * L, F]``."""
        if wp.mode == "local":
            return kv_tok
        if wp.mode == "allgather":
            return allgather_kv(kv_tok, self.group, self.world, self.traffic)
        if wp.mode == "a2a":
            recv = a2a_kv(kv_tok, wp.send_rows, wp.send_splits, wp.recv_splits, self.group, self.traffic)
        else:
            recv = halo_kv(kv_tok, wp.send_rows, wp.recv_splits[0], self.rank, self.world, self.group, self.traffic)
        return torch.cat([kv_tok, recv])

    # ---- reports --------------------------------------------------------------------------------------
    def comm_report(self, window_left: int = -1, *, chunk: int = -1, bytes_per_token: int = 1,
                    bidirectional: bool = False, whole_blocks: bool = False) -> dict:
        """Tokens (or bytes, with ``bytes_per_token = Hkv * (D + Dv) * element_size``) received and sent
        per rank by the chosen exchange and by the minimum (needed-only), for one window (and chunk length).
        Never communicates (a window not planned yet is planned here from the replicated doc ids), so one rank
        may log it alone."""
        wp = self.window_plan(window_left, chunk, bidirectional, whole_blocks)
        x = wp.exchange
        needed, sent = x.needed_tokens(), x.sent_tokens()
        ag = [x.allgather_tokens()] * self.world
        chosen_recv = {"local": [0] * self.world, "allgather": ag}.get(wp.mode, needed)
        chosen_sent = {"local": [0] * self.world, "allgather": ag}.get(wp.mode, sent)
        scale = bytes_per_token
        return {
            "mode": wp.mode,
            "reason": wp.reason,
            "recv": [n * scale for n in chosen_recv],
            "sent": [n * scale for n in chosen_sent],
            "min_recv": [n * scale for n in needed],
            "min_sent": [n * scale for n in sent],
            "allgather_recv": [n * scale for n in ag],
        }


def choose_exchange(xplan: ExchangePlan, requested: str) -> tuple[str, str]:
    """The exchange for a window, identical on every rank (a function of the plan alone), with its reason."""
    world = xplan.world
    needed = sum(xplan.needed_tokens())
    ag = world * xplan.allgather_tokens()
    if world == 1:
        return "local", "CP size 1: no other rank"
    if requested == "allgather":
        return "allgather", "requested"
    if requested == "halo":
        if not xplan.halo_ok:
            s, d = _first_non_neighbour_pair(xplan)
            raise ValueError(
                f"kv_exchange='halo': expected every rank's needed keys on its left neighbour, got rank {d} "
                f"needing {int(xplan.counts[s, d])} tokens from rank {s}; use 'a2a' or 'auto'"
            )
        return "halo", "requested"
    if requested == "a2a":
        return "a2a", "requested"
    if needed == 0:
        return "local", "no rank needs keys held by another rank"
    if xplan.halo_ok:
        return "halo", f"every rank's needed keys lie on its left neighbour ({needed} of {ag} all-gather tokens)"
    if needed < ag:
        return "a2a", f"needed-only all-to-all moves {needed} of {ag} all-gather tokens"
    return "allgather", f"every rank needs every other rank's tokens ({needed} = {ag})"


def _chunk_text(chunk: int) -> str:
    return "" if chunk < 0 else f", chunks of {chunk}"


def _first_non_neighbour_pair(xplan: ExchangePlan) -> tuple[int, int]:
    for s, d in xplan.counts.nonzero().tolist():
        if s != d - 1:
            return s, d
    raise AssertionError("halo_ok is False but every pair is a neighbour pair")


_logged: set[str] = set()  # the kinds logged: bounded by the kinds of message, not by the steps
_logged_lock = threading.Lock()
_NUMBER = re.compile(r"\d+")


def _log_once(message: str, kind: str | None = None) -> None:
    """Log ``message`` at INFO the first time a message of its ``kind`` appears in this process; by default messages
    that differ only in their numbers (token counts, shapes, image counts, which change every step) are one kind."""
    kind = _NUMBER.sub("#", message) if kind is None else kind
    with _logged_lock:
        if kind in _logged:
            return
        _logged.add(kind)
    log.info(message)


# ---- activation ---------------------------------------------------------------------------------------
_active: list[StepState] = []
_active_lock = threading.Lock()
_last_exited: weakref.ref | None = None


def current_state() -> StepState | None:
    """The innermost active step state (visible from every thread), or None."""
    with _active_lock:
        return _active[-1] if _active else None


def last_exited_state() -> StepState | None:
    """The most recently exited step state, while something still holds it (e.g. an autograd graph)."""
    return _last_exited() if _last_exited is not None else None


def _active_guard() -> _guard.StepGuard | None:
    """The innermost active step's guard, read without the lock (called before every module's forward)."""
    try:
        return _active[-1].guard
    except IndexError:
        return None


@contextlib.contextmanager
def activate(state: StepState) -> Iterator[StepState]:
    """Make ``state`` the active step state for the duration of the block, with the guard that refuses layers
    not computed per document (:mod:`blockdiag_dist.guard`); on a normal exit, raise
    :class:`AttentionNotRoutedError` if the step expects attention and no call reached it."""
    global _last_exited
    with _active_lock:
        _active.append(state)
    _guard.install(_active_guard)
    try:
        yield state
    finally:
        _guard.uninstall()
        with _active_lock:
            # remove this exact entry (contexts of different steps may interleave across threads)
            for i in range(len(_active) - 1, -1, -1):
                if _active[i] is state:
                    del _active[i]
                    break
            _last_exited = weakref.ref(state)
    state.check_attention_seen()  # not reached when the block raised: its error is the one to see
