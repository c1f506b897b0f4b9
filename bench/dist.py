"""Benchmarks on real process groups (run on every rank of a verify.pool.WorkerPool)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from blockdiag_dist import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.exchange.allgather import all_gather_tensor
from verify.pool import worker_info

from .memory import peak_bytes, reset_peak

from verify.workloads import D, H, HKV, layout_of, long_tail

__all__ = ["consensus_collectives", "consensus_cost", "peak_memory", "timed_steps"]


def _step_fn(ids: torch.Tensor, mesh, config: dict, seed: int):
    S = ids.shape[1]
    batch = {"inputs_embeds": torch.zeros(1, S, 1), "_packed_seq_ids": ids}
    ctx, batch = make_cp_blockdiag_batch_and_ctx(
        mesh, None, batch, kv_exchange=config.get("kv_exchange", "auto"), kernel=config.get("kernel", "varlen"),
        layout=config.get("layout", "contiguous"),
    )
    L = batch["inputs_embeds"].shape[1]
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    q, k, v = (torch.randn(1, h, L, D, generator=g, requires_grad=True) for h in (H, HKV, HKV))
    grad_out = torch.randn(1, H, L, D, generator=g)

    def step() -> None:
        with ctx():
            out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad_out)

    return ctx.state, step


def _exchange_fn(state):
    """The exchange alone, forward and backward, on this rank's packed K/V tokens (no attention)."""
    wp = state.window_plan(-1)
    kv_tok = torch.randn(state.batch_size * state.local_len, HKV * 2 * D, requires_grad=True)

    def run() -> None:
        buf = state.exchange(kv_tok, wp)
        torch.autograd.grad(buf, kv_tok, torch.ones_like(buf))

    return run


def timed_steps(S: int, seed: int, configs: list[dict], reps: int) -> dict:
    """Median forward + backward step time of each config, and of its exchange alone, measured in alternation
    between barriers (so a step's time is the slowest rank's), plus the K/V bytes each config moved per step on
    this rank."""
    mesh = worker_info()["cp_mesh"]
    ids = layout_of(long_tail(S, seed)).doc_ids
    steps, states = {}, {}
    for config in configs:
        try:
            states[config["name"]], steps[config["name"]] = _step_fn(ids, mesh, config, seed)
        except ValueError as exc:  # e.g. halo where it cannot work: every rank decides the same
            states[config["name"]] = str(exc)
    exchanges = {name: _exchange_fn(states[name]) for name in steps}
    times: dict[str, list[float]] = {name: [] for name in steps}
    exchange_times: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(reps + 1):
        for name in steps:
            for fn, record in ((steps[name], times[name]), (exchanges[name], exchange_times[name])):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                if rep:  # the first round warms up
                    record.append(time.perf_counter() - t0)
    out = {}
    for config in configs:
        name = config["name"]
        state = states[name]
        if isinstance(state, str):
            out[name] = {"skipped": state}
            continue
        fwd = state.traffic.totals("forward")
        wp = state.window_plan(-1)
        bpt = HKV * 2 * D * 4
        out[name] = {
            "seconds": statistics.median(times[name]),
            "exchange_seconds": statistics.median(exchange_times[name]),
            "mode": wp.mode,
            "recv_bytes_per_step": fwd["recv_bytes"] // max(fwd["calls"], 1),
            "min_recv_bytes": wp.exchange.needed_tokens()[dist.get_rank()] * bpt,
            "allgather_recv_bytes": wp.exchange.allgather_tokens() * bpt,
            "work": state.plan.work_per_rank()[dist.get_rank()],
        }
    return out


def peak_memory(S: int, seed: int) -> dict:
    """Peak resident memory of this rank over one varlen + needed-only step at sequence length ``S`` (its plans
    and inputs included): the high-water mark reset first, so that what its parent held when it spawned the rank
    does not count (:mod:`bench.memory`)."""
    mesh = worker_info()["cp_mesh"]
    reset_peak()
    ids = layout_of(long_tail(S, seed)).doc_ids
    state, step = _step_fn(ids, mesh, {"kv_exchange": "auto", "kernel": "varlen"}, seed)
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    return {
        "peak_rss_bytes": peak_bytes(),
        "mode": state.window_plan(-1).mode,
        "local_len": state.local_len,
        "seconds": seconds,
    }


def consensus_cost(S: int, seed: int, reps: int) -> dict:
    """Median time of the batch function with and without the plan consensus check (alternating, between
    barriers), and of one attention step, at sequence length ``S``."""
    mesh = worker_info()["cp_mesh"]
    ids = layout_of(long_tail(S, seed)).doc_ids
    times: dict[str, list[float]] = {"on": [], "off": [], "step": []}
    _, step = _step_fn(ids, mesh, {}, seed)
    for rep in range(reps + 1):
        for name in ("on", "off", "step"):
            batch = {"inputs_embeds": torch.zeros(1, S, 1), "_packed_seq_ids": ids}
            dist.barrier()
            t0 = time.perf_counter()
            if name == "step":
                step()
            else:
                make_cp_blockdiag_batch_and_ctx(mesh, None, batch, check_consensus=name == "on")
            dist.barrier()
            if rep:
                times[name].append(time.perf_counter() - t0)
    out = {name: statistics.median(t) for name, t in times.items()}
    out["collectives"] = consensus_collectives(200 if reps > 3 else 100)
    return out


def consensus_collectives(calls: int) -> dict:
    """Per call, side by side (alternating, between barriers): this rank's CPU and the wall time of the collective
    the consensus check runs, an all-reduce (MAX) of two int64, and of the all-gather of one int64 per rank it
    replaced (docs/scale.md, tenth pass)."""
    group = worker_info()["cp_mesh"].get_group()
    world = dist.get_world_size(group)
    pair, one, gathered = (torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                           torch.empty(world, dtype=torch.int64))
    run = {"all_reduce": lambda: dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=group),
           "all_gather": lambda: all_gather_tensor(gathered, one, group=group)}
    per_round = calls // 2
    cpu, wall = dict.fromkeys(run, 0.0), dict.fromkeys(run, 0.0)
    for _ in range(2):
        for name, fn in run.items():
            dist.barrier(group)
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(per_round):
                fn()
            cpu[name] += time.process_time() - c0
            wall[name] += time.perf_counter() - t0
    return {name: {"cpu_ms": cpu[name] / (2 * per_round) * 1e3, "wall_ms": wall[name] / (2 * per_round) * 1e3}
            for name in run}
