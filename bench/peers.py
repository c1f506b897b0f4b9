"""Peers side by side: one attention fwd + bwd at CP 2 (2 gloo processes x 1 thread) against the single-device
limit on the same cores (one process x 2 threads: torch's SDPA per document), for blockdiag (contiguous,
balanced, auto) and the third-party implementations reached through ``verify.adapters`` (NeMo Automodel
``blockdiag_cp``, ring-attention-pytorch). Every configuration's output and q, k, v gradients are checked
in the same run against the single-device result.
"""

from __future__ import annotations

import functools
import importlib
import statistics
import time
import types

import torch
import torch.distributed as dist

from verify.pool import WorkerPool, worker_info

from verify.workloads import D, H, HKV, layout_of, long_tail

__all__ = ["PEERS", "bench_peers"]

OURS = {f"blockdiag {name}": name for name in ("contiguous", "balanced", "auto")}
PEERS = {"NeMo blockdiag_cp": "nemo", "ring-attention-pytorch": "ring_attention"}
# what a peer cannot compute by its declared conventions (verify/adapters): not timed, the reason shown
NOT_APPLICABLE = {("ring-attention-pytorch", "long-tail"): "no document masks (one causal sequence per row)"}
CHECK_RTOL = 1e-4  # float32 CP result vs float32 single-device result, relative to the largest magnitude


def workload(name: str, S: int) -> list[int]:
    """Document lengths: ``one-doc`` (one causal document) or ``long-tail`` (packed long-tail documents)."""
    return [S] if name == "one-doc" else long_tail(S, 0)


def _inputs(S: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, S, D, generator=g) for h in (H, HKV, HKV))
    return q, k, v, torch.randn(1, H, S, D, generator=g)


def _module(impl: str, layout: str | None):
    """The module behind a configuration; blockdiag with its layout bound into the batch function."""
    if layout is None:
        from verify.adapters import module_path

        return importlib.import_module(module_path(impl))
    import blockdiag_dist

    make = functools.partial(blockdiag_dist.make_cp_blockdiag_batch_and_ctx, layout=layout)
    return types.SimpleNamespace(make_cp_blockdiag_batch_and_ctx=make, cp_blockdiag_sdpa=blockdiag_dist.cp_blockdiag_sdpa)


def _prepare(module, mesh, q, k, v, grad, ids):
    """Shard once (the batch function is per step, attention per layer); return the timed fwd + bwd closure
    and a one-shot run returning this rank's rows and q, k, v gradients for the check."""
    B, _, S, _ = q.shape
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    packed = torch.cat([t.transpose(1, 2).reshape(B, S, -1) for t in leaves], dim=-1)
    batch = {"inputs_embeds": packed, "position_ids": torch.arange(S).expand(B, S).clone(), "_packed_seq_ids": ids}
    ctx, batch = module.make_cp_blockdiag_batch_and_ctx(mesh, None, batch)[:2]
    x = batch["inputs_embeds"]
    L = x.shape[1]
    positions = batch["position_ids"]
    padding = batch["padding_mask"].to(torch.bool)
    g = torch.where(padding[:, None, :, None], 0.0, grad[:, :, positions.clamp(max=S - 1)[0]])

    x_local = x.detach().requires_grad_()  # the timed step starts from this rank's rows, as a layer does

    def qkv(rows):
        qs, ks, vs = rows.split([H * D, HKV * D, HKV * D], dim=-1)
        return [t.reshape(B, L, -1, D).transpose(1, 2) for t in (qs, ks, vs)]

    def step() -> None:
        with ctx():
            out = module.cp_blockdiag_sdpa(*qkv(x_local), is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, x_local, g)

    def check() -> dict:
        with ctx():
            out = module.cp_blockdiag_sdpa(*qkv(x), is_causal=True, enable_gqa=True)
            grads = torch.autograd.grad(out, leaves, g)
        return {"out": out.detach(), "positions": positions[0], "padding": padding[0], "grads": grads}

    return step, check


def peer_steps(lengths: list[int], configs: dict[str, tuple[str, str | None]], reps: dict[str, int], check: bool) -> dict:
    """On every rank: for each configuration, its check result (rank's rows and gradient contributions) and
    the median fwd + bwd time between barriers (the slowest rank's, once maxed over ranks)."""
    mesh = worker_info()["cp_mesh"]
    ids = layout_of(lengths).doc_ids
    q, k, v, grad = _inputs(ids.shape[1])
    steps, out = {}, {}
    for name, (impl, layout) in configs.items():
        try:
            steps[name], checker = _prepare(_module(impl, layout), mesh, q, k, v, grad, ids)
        except (ImportError, ValueError) as exc:  # every rank decides the same
            out[name] = {"skipped": f"{type(exc).__name__}: {exc}"}
            continue
        dist.barrier()
        out[name] = {"check": checker() if check else None}  # also the warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(max(reps.values(), default=0)):
        for name, step in steps.items():
            if rep >= reps[name]:
                continue
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        out[name]["seconds"] = statistics.median(ts)
    return out


def _single_device(lengths: list[int], reps: int) -> tuple[float, dict]:
    """torch's SDPA per document on exact-size slices, one process with every core: time and result."""
    q, k, v, grad = _inputs(sum(lengths))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def run():
        outs, s = [], 0
        for n in lengths:
            sl = slice(s, s + n)
            outs.append(torch.nn.functional.scaled_dot_product_attention(*(t[:, :, sl] for t in leaves), is_causal=True, enable_gqa=True))
            s += n
        out = torch.cat(outs, 2)
        return out, torch.autograd.grad(out, leaves, grad)

    out, grads = run()  # warm-up and the check's reference
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), {"out": out.detach(), "grads": grads}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _check(per_rank: list[dict], single: dict) -> dict:
    """Largest relative errors of the CP result (real rows, gradients summed over ranks) vs single device."""
    out = single["out"]
    errs = {"out": 0.0}
    for r in per_rank:
        real = ~r["padding"] & (r["positions"] < out.shape[2])
        errs["out"] = max(errs["out"], _rel(r["out"][:, :, real], out[:, :, r["positions"][real]]))
    for i, name in enumerate(("dq", "dk", "dv")):
        errs[name] = _rel(sum(r["grads"][i] for r in per_rank), single["grads"][i])
    worst = max(errs.values())
    return {"max_rel_err": worst, "errors": errs, "ok": worst <= CHECK_RTOL}


def bench_peers(S: int, rounds: int, reps: int, peer_reps: int = 1, cp: int = 2, with_peers: bool = True) -> dict:
    """Per workload: single-device time, and per configuration its CP time (median over rounds of per-round
    medians), its ratio to single device in every round (the spread), and its correctness check."""
    from verify.adapters import ADAPTERS

    threads = torch.get_num_threads()
    configs: dict[str, tuple[str, str | None]] = {name: ("blockdiag_dist", layout) for name, layout in OURS.items()}
    missing = {}
    for name, impl in PEERS.items() if with_peers else ():
        mod = importlib.import_module(ADAPTERS[impl])
        if getattr(mod, "UNAVAILABLE", None):
            missing[name] = mod.UNAVAILABLE
            print(f"bench: peer {name} is missing, its column stays empty (install the peers: make peers): {mod.UNAVAILABLE}", flush=True)
        else:
            configs[name] = (impl, None)
    rows = []
    with WorkerPool(cp, threads_per_worker=1, collective_timeout=1800) as pool:
        for wl in ("one-doc", "long-tail"):
            lengths = workload(wl, S)
            row = {"workload": wl, "S": S, "docs": len(lengths), "single_seconds": [], "configs": {}}
            for rnd in range(rounds):
                torch.set_num_threads(threads)
                t_single, single = _single_device(lengths, reps)
                row["single_seconds"].append(t_single)
                torch.set_num_threads(1)  # the parent only waits while the ranks run
                chosen = {n: c for n, c in configs.items() if (n, wl) not in NOT_APPLICABLE and (rnd == 0 or n in OURS)}
                per_rank = pool.run(peer_steps, args=(lengths, chosen, {n: reps if n in OURS else peer_reps for n in chosen}, rnd == 0),
                                    timeout=1800, name=f"peers {wl}")
                torch.set_num_threads(threads)
                for name in chosen:
                    res = row["configs"].setdefault(name, {"seconds": [], "ratio": []})
                    if "skipped" in per_rank[0][name]:
                        res["skipped"] = per_rank[0][name]["skipped"]
                        continue
                    t = max(r[name]["seconds"] for r in per_rank)
                    res["seconds"].append(t)
                    res["ratio"].append(t / t_single)
                    if rnd == 0:
                        res["check"] = _check([r[name]["check"] for r in per_rank], single)
            for name, why in missing.items():
                row["configs"][name] = {"skipped": f"not installed (make peers): {why}"}
            for (name, w), why in NOT_APPLICABLE.items():
                if w == wl and name in configs:
                    row["configs"][name] = {"skipped": why}
            for res in row["configs"].values():
                if res.get("seconds"):
                    res["median_seconds"] = statistics.median(res["seconds"])
                    res["median_ratio"] = statistics.median(res["ratio"])
            rows.append(row)
    from blockdiag_dist.plan import plan_step

    for row in rows:
        row["auto_layout"] = plan_step(layout_of(workload(row["workload"], S)).doc_ids, cp, "auto").shards.layout
    return {"cp": cp, "threads": threads, "heads": [H, HKV], "head_dim": D, "dtype": "float32", "rows": rows,
            "check_rtol": CHECK_RTOL, "missing": missing}
