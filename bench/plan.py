"""Bench section ``plan``: what one rank's per-step planning costs, on the host, as S and CP grow.

Every rank plans every step in the batch function before any GPU work. Two parts are timed apart:

- ``replicated``: what every rank computes for all ranks (pure, identical everywhere): ``plan_step`` (the layout
  choice and the shard plan), the exchange plan of the unwindowed attention (``exchange(-1)``, its per-pair
  counts) and the documents' pieces (``plan.documents``);
- ``scan``: the part of ``replicated`` that reads the doc ids once to find the documents
  (``DocLayout.from_doc_ids``), the floor any planning from per-token doc ids pays;
- ``rank``: this rank's own part, built from the replicated plan in the batch function: its window plan (key
  buffer, the runs of the rows it sends, the varlen kernel's pieces) and its documents' view (``state.docs``),
  all from intervals;
- ``step``: the whole batch function of this rank (``make_cp_blockdiag_batch_and_ctx`` without its process
  group): a collator's batch (``input_ids``, ``labels``, per-document ``position_ids``) in, the rank's shard and step
  state out. It reads the documents from the positions in one pass (``read``: :func:`blockdiag_ref.layout_from_batch`,
  no doc-id tensor), plans (``replicated`` and ``rank``, less the scan), and shards each tensor (this rank's rows
  only) and the padding mask (from the plan). Reported apart, not in ``total``;
- ``bounds``: the whole per-step planning of this rank (``replicated`` and ``rank``) from a flattening collator's
  batch that carries the documents' boundaries (``cu_seq_lens_q``, as ``DataCollatorWithFlattening(
  return_flash_attn_kwargs=True)`` gives): the documents are read from the boundaries alone, no per-token read,
  so it grows with documents and ranks only;
- ``first_use``: the token-level tensors of this rank, each built by its first reader: the varlen kernel's
  maskless blocks and padding rows (``VarlenMeta.blocks``, ``pad_rows``: the CPU path's; flash-attn on CUDA takes
  the pieces' ``cu_seqlens`` instead and never builds the blocks), the index of the rows it sends
  (``WindowPlan.send_rows``, one per token sent under halo or a2a, on the rank's device) and the documents'
  per-row tensors that mixers and positions read (``state.docs.doc_index``, ``doc_position``, ``token_index``).
  Reported apart, not in ``total``: they grow with the rank's tokens (``S / CP``) and the tokens it sends.

One packed row of documents with exponential lengths: ``few`` = 64 documents, ``many`` = 8,192 documents (a fixed
count at every S, so the growth ratio ``time(16M) / time(1M)`` compares equal document counts), and ``mean2k``
(documents of mean 2,000 tokens, the issue's workload; the count grows with S).

Run ``python -m bench --only plan`` (or :func:`time_plan` for one case)::

    >>> from bench.plan import time_plan
    >>> row = time_plan(1 << 17, 8, "few", "contiguous", reps=1)
    >>> sorted(row) == ['S', 'bounds_ms', 'cp', 'docs', 'first_use_ms', 'layout', 'mix', 'rank_ms', 'read_ms',
    ...                 'replicated_ms', 'scan_ms', 'step_ms', 'total_ms']
    True

The section ends with the goal lines (:func:`plan_goals`): per layout, the worst case at S = 1M / CP 64 (<= 20 ms)
and at S = 16M / CP 1,024 (<= 100 ms) of ``total`` (from per-token doc ids), and the worst growth ``time(16M) /
time(1M)`` at equal documents (<= 1.5) of ``bounds`` (from the boundaries) and of ``total`` (from doc ids, which
reads every token once).
"""

from __future__ import annotations

import time
from functools import lru_cache

import numpy as np
import torch

from blockdiag_dist import CPOptions
from blockdiag_dist.batch import _step
from blockdiag_dist.plan import plan_step
from blockdiag_dist.state import StepState
from blockdiag_ref import DocLayout, layout_from_batch

MIXES = {"few": 64, "many": 8192}  # documents per row, at every S
LAYOUTS = ("contiguous", "balanced", "auto")


def doc_ids_of(S: int, mix: str, seed: int = 0) -> torch.Tensor:
    """int64 ``[1, S]``: one row of documents with exponential lengths (``mix`` in ``MIXES`` or ``mean2k``)."""
    rng = np.random.default_rng(seed)
    n = max(1, S // 2000) if mix == "mean2k" else min(MIXES[mix], S)
    w = rng.exponential(1.0, n)
    lengths = np.maximum(1, np.floor(w / w.sum() * S).astype(np.int64))
    lengths[-1] += S - lengths.sum()
    while lengths[-1] < 1:  # the rounding took too much from the last one: give it back from the longest
        k = int(np.argmax(lengths[:-1]))
        lengths[k] -= 1
        lengths[-1] += 1
    ids = torch.repeat_interleave(torch.arange(1, n + 1), torch.from_numpy(lengths))
    return ids[None]


@lru_cache(maxsize=1)
def collated_batch(S: int, mix: str) -> dict[str, torch.Tensor]:
    """What a flattening collator gives for the row of :func:`doc_ids_of`: ``input_ids``, ``labels`` and the
    per-document ``position_ids`` (one row, no padding)."""
    ids = doc_ids_of(S, mix)
    return {"input_ids": ids, "labels": ids, "position_ids": DocLayout.from_doc_ids(ids).doc_positions}


@lru_cache(maxsize=1)
def bounded_batch(S: int, mix: str) -> dict[str, object]:
    """:func:`collated_batch` with the documents' boundaries a flattening collator adds for flash-attn
    (``cu_seq_lens_q/k`` int32 ``[n + 1]``, ``max_length_q/k``)."""
    batch = dict(collated_batch(S, mix))
    layout = DocLayout.from_doc_ids(batch["input_ids"])
    cu = layout.cu_seqlens.to(torch.int32)
    longest = int(layout.max_seqlen)
    return {**batch, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _replicated(ids: torch.Tensor | DocLayout, world: int, layout: str):
    plan = plan_step(ids, world, layout)
    plan.exchange(-1).needed_tokens()
    plan.documents  # noqa: B018
    return plan


def _rank(plan, rank: int):
    state = StepState(plan, rank=rank, group=None, device=torch.device("cpu"), kv_exchange="auto", kernel="varlen")
    state.window_plan(-1)
    state.docs  # noqa: B018
    return state


def _first_use(state) -> None:
    wp, docs = state.window_plan(-1), state.docs
    wp.kernel_meta.blocks, wp.kernel_meta.pad_rows, wp.send_rows  # noqa: B018
    docs.doc_index, docs.doc_position, docs.token_index  # noqa: B018


def _best_ms(fn, reps: int, setup=lambda: None):
    """(best milliseconds of ``reps`` calls of ``fn(setup())``, one after the other, setup untimed; the last result).
    Each part runs its repeats back to back, so that none is timed in the caches another part left cold."""
    best, out = float("inf"), None
    for _ in range(reps):
        arg = setup()
        t0 = time.perf_counter()
        out = fn(arg)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, out


def time_plan(S: int, world: int, mix: str, layout: str, reps: int = 3, rank: int | None = None) -> dict:
    """Best of ``reps`` milliseconds of one rank's planning of one step, each part timed on its own (the noise of a
    shared machine only ever adds time; ``rank``: default the last rank, which holds the most document ends under
    contiguous sharding)."""
    batch, bounded = collated_batch(S, mix), bounded_batch(S, mix)
    ids = batch["input_ids"]
    rank = world - 1 if rank is None else rank
    options = CPOptions(layout=layout, kv_exchange="auto", kernel="varlen", check_consensus=False)
    bounds, _ = _best_ms(lambda _: _rank(_replicated(layout_from_batch(bounded, S, 1), world, layout), rank), reps)
    read, _ = _best_ms(lambda _: layout_from_batch(batch, S, 1), reps)
    # the batch is read, never written into
    step, _ = _best_ms(lambda _: _step(dict(batch), None, options, None, world, rank), reps)
    scan, _ = _best_ms(lambda _: DocLayout.from_doc_ids(ids), reps)
    rep, plan = _best_ms(lambda _: _replicated(ids, world, layout), reps)
    rk, _ = _best_ms(lambda _: _rank(plan, rank), reps)
    first, _ = _best_ms(_first_use, reps, setup=lambda: _rank(plan, rank))
    return {"S": S, "cp": world, "mix": mix, "docs": int(ids.max()), "layout": layout, "replicated_ms": rep,
            "rank_ms": rk, "total_ms": rep + rk, "scan_ms": scan, "first_use_ms": first, "read_ms": read,
            "step_ms": step, "bounds_ms": bounds}


def bench_plan(sizes, cps, mixes=tuple(MIXES), layouts=LAYOUTS, reps: int = 3, extra=(), threads: int = 1) -> dict:
    """The sweep: every (S, CP, mix, layout) of the grid, then the ``extra`` cases ``(S, CP, mix, layout)``;
    with the growth ratios ``time(S_max) / time(1M)`` (``time(S_min)`` when the sweep stops at 1M) at each (CP, mix,
    layout).

    Measured with ``threads`` torch threads (default 1): planning is many small host operations, and on a
    shared machine the barrier of a multi-threaded pool dominates them (on this 2-core machine under load, one
    ``searchsorted`` of 2,048 values took 17 ms with 2 threads and 8 us with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = [time_plan(S, cp, mix, layout, reps) for S in sizes for cp in cps for mix in mixes for layout in layouts]
        rows += [time_plan(S, cp, mix, layout, reps) for S, cp, mix, layout in extra]
    finally:
        torch.set_num_threads(before)
    growth = []
    lo, hi = (1 << 20 if 1 << 20 in sizes and max(sizes) > 1 << 20 else min(sizes)), max(sizes)
    for cp in cps:
        for mix in mixes:
            for layout in layouts:
                a = [r for r in rows if (r["S"], r["cp"], r["mix"], r["layout"]) == (lo, cp, mix, layout)]
                b = [r for r in rows if (r["S"], r["cp"], r["mix"], r["layout"]) == (hi, cp, mix, layout)]
                if a and b:
                    growth.append({"cp": cp, "mix": mix, "layout": layout, "S_from": lo, "S_to": hi,
                                   "replicated": b[0]["replicated_ms"] / a[0]["replicated_ms"],
                                   "total": b[0]["total_ms"] / a[0]["total_ms"],
                                   "bounds": b[0]["bounds_ms"] / a[0]["bounds_ms"]})
    return {"rows": rows, "growth": growth, "threads": threads, "goals": plan_goals(rows, growth, layouts)}


# The goals for the whole per-step planning of one rank: (S, CP) -> milliseconds, and the growth in S.
GOAL_MS = {(1 << 20, 64): 20.0, (1 << 24, 1024): 100.0}
GOAL_GROWTH = 1.5  # time(16M) / time(1M) at equal document count


def plan_goals(rows: list[dict], growth: list[dict], layouts=LAYOUTS) -> list[dict]:
    """Per layout and goal: the worst measured case against the limit (``met`` None where the sweep did not
    measure it). Milliseconds: ``total_ms`` at each (S, CP) of :data:`GOAL_MS`, every document mix; growth: of the
    growth rows from 1M to 16M (equal document counts: ``few`` and ``many``), ``bounds`` (planning from the
    documents' boundaries) and ``total`` (from per-token doc ids: their one read grows with S)."""
    out = []
    for layout in layouts:
        for (S, cp), limit in GOAL_MS.items():
            got = [r for r in rows if (r["S"], r["cp"], r["layout"]) == (S, cp, layout)]
            worst = max(got, key=lambda r: r["total_ms"]) if got else None
            out.append({"goal": f"<= {limit:g} ms at S={S / 2**20:g}M, CP {cp}", "layout": layout, "limit": limit,
                        "figure": worst["total_ms"] if worst else None,
                        "case": f"{worst['mix']} ({worst['docs']} documents)" if worst else "not measured",
                        "met": (worst["total_ms"] <= limit) if worst else None})
        got = [g for g in growth if g["layout"] == layout and (g["S_from"], g["S_to"]) == (1 << 20, 1 << 24)]
        for key, source in (("bounds", "from boundaries"), ("total", "from doc ids")):
            worst = max(got, key=lambda g: g[key]) if got else None
            out.append({"goal": f"time(16M) / time(1M) <= {GOAL_GROWTH:g} at equal documents, {source}",
                        "layout": layout, "limit": GOAL_GROWTH, "figure": worst[key] if worst else None,
                        "case": f"CP {worst['cp']}, {worst['mix']}" if worst else "not measured",
                        "met": (worst[key] <= GOAL_GROWTH) if worst else None})
    return out
