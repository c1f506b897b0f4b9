"""Step ``multirank``: CP 2 and CP 4 with the device's tensors, on one machine.

NCCL needs one GPU per rank. With fewer GPUs than ranks (one H200) the ranks share the GPU and every
collective goes through host memory over gloo (:mod:`verify.gpu.staging`: gloo's support for CUDA tensors
in all-to-all and point-to-point is not known, and a hang would cost the device window); the kernels stay on
the GPU. The step first probes, on the launched group, each collective the K/V exchanges and the mixers use
(with the exact functions ``blockdiag_dist`` calls, in float32 and bfloat16, checking the values that arrive),
then runs the verifier's cases whose collectives passed, their expected results computed on the same device:
flash-attn's path first (bfloat16, head dim 64, a padding-only rank, windows, a soft-cap), then the mixers
(Gated DeltaNet, Mamba2, convolution), then the attention cases over every kernel x exchange x layout (exactly
the cases the matrix runs), the cases that reach fla last. An exchange whose collective failed is reported as
unsupported, with the collective's error and the error of one of its cases, run to show it. On CPU (the dry run)
the same code runs, flash-attn and fla emulated.
"""

from __future__ import annotations

import os
import time
import traceback

import torch

from blockdiag_dist.options import LAYOUTS
from blockdiag_dist.state import choose_exchange

from ..cases import NAMED_LAYOUTS, Case, default_matrix, mixer_matrix
from ..pool import PoolError, WorkerPool
from ..runner import case_exchange_plan
from ..session import CaseResult, Session
from . import emulate, staging
from .mixers import reaches_fla
from .step import StepContext

__all__ = ["PROBES", "cases", "exchange_mode", "flash_cases", "probe", "run", "summarize"]

CPS = (2, 4)
KERNELS = ("varlen", "dense")
EXCHANGES = ("auto", "allgather", "halo", "a2a")
QUICK_LAYOUTS = ("padding-rank",)
FLASH_LAYOUTS = ("padding-rank", "many-short", "middle-padding", "spans-every-rank")
PROBE_DTYPES = ("float32", "bfloat16")
# the collectives each exchange mode issues (forward and backward); "mixer": what the mixers' exchanges use
NEEDS = {
    "local": (),
    "allgather": ("all_gather_into_tensor", "reduce_scatter_tensor"),
    "a2a": ("all_to_all_single",),
    "halo": ("batch_isend_irecv",),
    "mixer": ("all_to_all_single", "batch_isend_irecv"),
}
PROBES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "batch_isend_irecv",
          "all_reduce", "broadcast", "all_gather")
IMPL = "blockdiag_dist"
CHUNK = 16  # cases submitted at once; the step checks its deadline between chunks


def init_staged() -> None:
    """A rank sharing the GPU: collectives through host memory, flash-attn's and fla's calls counted."""
    staging.install()
    emulate.count_real_calls()


def init_staged_emulated() -> None:
    """A rank of the CPU dry run: the same staging, flash-attn and fla emulated."""
    staging.install()
    emulate.install()


# ---- on every rank -------------------------------------------------------------------------------------
def _probe_once(op: str, dtype: torch.dtype, device: torch.device) -> None:
    """Run ``op`` once and assert the values that arrive (small integers: exact in bfloat16 too)."""
    import torch.distributed as dist

    from blockdiag_dist.exchange.allgather import all_gather_tensor, reduce_scatter_tensor

    rank, world = dist.get_rank(), dist.get_world_size()

    def t(values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.float32).to(device=device, dtype=dtype)

    def rows(r: int) -> list[float]:
        return [float(10 * r + i) for i in range(4)]

    if op == "all_gather_into_tensor":
        got = t([0.0] * 4 * world)
        all_gather_tensor(got, t(rows(rank)))
        want = t([x for r in range(world) for x in rows(r)])
    elif op == "reduce_scatter_tensor":
        got = t([0.0] * 4)
        reduce_scatter_tensor(got, t([float(i + rank) for i in range(4 * world)]), op=dist.ReduceOp.SUM)
        want = t([float(world * i + sum(range(world))) for i in range(4 * rank, 4 * rank + 4)])
    elif op == "all_to_all_single":  # uneven splits, as the a2a exchange sends them
        send = [j + 1 for j in range(world)]
        got = t([0.0] * (rank + 1) * world)
        dist.all_to_all_single(got, t([float(100 * rank + j) for j in range(world) for _ in range(j + 1)]),
                               [rank + 1] * world, send)
        want = t([float(100 * s + rank) for s in range(world) for _ in range(rank + 1)])
    elif op == "batch_isend_irecv":  # a ring to the right, as the halo exchange shifts keys
        got = t([0.0] * 4)
        ops = [dist.P2POp(dist.isend, t(rows(rank)), (rank + 1) % world), dist.P2POp(dist.irecv, got, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        want = t(rows((rank - 1) % world))
    elif op == "all_reduce":
        got = t(rows(rank))
        dist.all_reduce(got)
        want = t([sum(10 * r + i for r in range(world)) for i in range(4)])
    elif op == "broadcast":
        got = t(rows(rank))
        dist.broadcast(got, src=0)
        want = t(rows(0))
    elif op == "all_gather":
        parts = [t([0.0] * 4) for _ in range(world)]
        dist.all_gather(parts, t(rows(rank)))
        got, want = torch.cat(parts), t([x for r in range(world) for x in rows(r)])
    else:
        raise ValueError(f"probe: expected one of {PROBES}, got {op!r}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want.cpu()), f"{op}: wrong values arrived: {got.cpu().tolist()} != {want.cpu().tolist()}"


def probe(op: str, device_type: str) -> dict[str, str]:
    """On every rank of a pool: ``op`` in each probe dtype; 'ok' or the error's last line, per dtype."""
    device = torch.device(device_type)
    out = {}
    for name in PROBE_DTYPES:
        try:
            _probe_once(op, getattr(torch, name), device)
            out[name] = "ok"
        except Exception:  # noqa: BLE001 - raised alike on every rank (a device check): the ranks stay in step
            out[name] = _last_line(traceback.format_exc())
    return out


# ---- in the step's process -----------------------------------------------------------------------------
def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:400] if lines else ""


def exchange_mode(case: Case) -> str | None:
    """The exchange the implementation will run for this case (a function of the plan alone; "mixer" for a
    mixer case); None if the requested exchange cannot serve the layout (halo where a rank needs keys beyond
    its left neighbour)."""
    if case.layer != "attention":
        return "mixer"
    try:
        return choose_exchange(case_exchange_plan(case), case.exchange or "auto")[0]
    except ValueError:
        return None


def flash_cases(cp: int, quick: bool) -> list[Case]:
    """flash-attn's path at this CP size: bfloat16, head dim 64, varlen, the padding-only rank's layout under
    each sharding layout, windows and a soft-cap rotating."""
    out, k = [], 0
    for name in FLASH_LAYOUTS[:1] if quick else FLASH_LAYOUTS:
        for layout in ("contiguous", "balanced"):
            out.append(Case(rows=NAMED_LAYOUTS[name](cp), cp=cp, name=name, hq=8, hkv=2, dim=64, kernel="varlen", layout=layout,
                            dtype="bfloat16", window=(-1, 8)[k % 2], softcap=(0.0, 0.0, 30.0)[k % 3], seed=k))
            k += 1
    return out


def cases(cp: int, quick: bool) -> list[Case]:
    """flash-attn's cases, the mixers (float32), bfloat16 with the default exchange and layout, then float32
    over every kernel x exchange x layout (the first layout only when ``quick``; then only the cases of
    ``QUICK_LAYOUTS``, and each layer's first case where it has none there); the cases that reach fla last."""
    layouts = tuple(LAYOUTS)[:1] if quick else tuple(LAYOUTS)
    out = [*flash_cases(cp, quick),
           *mixer_matrix(cps=(cp,), dtypes=("float32",), layouts=("contiguous", "balanced")),
           *default_matrix(cps=(cp,), dtypes=("bfloat16",), kernels=KERNELS, exchanges=("auto",), layouts=("contiguous",),
                           cover=False),
           *default_matrix(cps=(cp,), dtypes=("float32",), kernels=KERNELS, exchanges=EXCHANGES, layouts=layouts,
                           cover=False)]
    out = [c for c in out if exchange_mode(c) is not None]
    if quick:
        kept = [c for c in out if c.name in QUICK_LAYOUTS]
        # a mixer layer the matrix thins (its spec's layouts_per_cp) may meet none of the quick layouts at this CP
        # size: its first case runs instead, so that every layer runs on the GPU's ranks
        missing = sorted({c.layer for c in out} - {c.layer for c in kept})
        out = kept + [next(c for c in out if c.layer == layer) for layer in missing]
    return sorted(out, key=reaches_fla)  # last: each rank's first fla call compiles Triton kernels


def _probe_all(pool: WorkerPool, device: str, timeout: float) -> dict[str, dict[str, str]]:
    """{op: {dtype: 'ok' | error}}; a rank that died or hung fails the op in every dtype."""
    result = {}
    for op in PROBES:
        try:
            per_rank = pool.run(probe, args=(op, device), timeout=timeout, name=f"probe {op}")
            result[op] = {d: next((r[d] for r in per_rank if r[d] != "ok"), "ok") for d in PROBE_DTYPES}
        except PoolError as exc:
            why = f"{exc.failure.kind}: " + _last_line(next(iter(exc.failure.details.values()), ""))
            result[op] = {d: why for d in PROBE_DTYPES}
    return result


def _short(r: CaseResult) -> dict:
    return {"label": r.case.label(), "status": r.status, "error": _last_line(r.details) if r.status != "fail" else r.details[:2000],
            "reproduce": r.case.command(r.impl)}


def _run_cp(ctx: StepContext, cp: int, backend: str, finish_by: float) -> None:
    """Probe, then the cases of one CP size; no new chunk of cases starts after ``finish_by`` (monotonic)."""
    out: dict = {"backend": backend, "device": ctx.device, "probe": {}, "planned": 0, "run": 0, "passed": 0,
                 "by_exchange": {}, "failed": [], "unsupported": {}}
    ctx.data["cps"][str(cp)] = out  # saved as it grows
    t0 = time.monotonic()
    init = init_staged_emulated if ctx.device == "cpu" else init_staged if backend == "gloo" else emulate.count_real_calls
    out["collectives"] = "through host memory (verify.gpu.staging)" if backend == "gloo" else f"{backend}, on the device"
    with Session(IMPL, case_timeout=30 if ctx.device == "cuda" else 60, backend=backend, device=ctx.device,
                 worker_init=init) as session:
        pool = session.pool(cp)
        pool.start_timeout = max(pool.start_timeout, finish_by - time.monotonic())  # a loaded machine starts slowly
        try:
            pool.start()
        except PoolError as exc:  # e.g. the ranks could not join a group with this backend and device
            out["error"] = f"the {cp} ranks could not start: {exc}"[-3000:]
            return
        out["seconds"] = {"pool_start": time.monotonic() - t0}
        out["probe"] = _probe_all(pool, ctx.device, timeout=60)  # the pool the cases then run on
        out["seconds"]["probe"] = time.monotonic() - t0 - out["seconds"]["pool_start"]
        todo, skipped = [], []
        for c in cases(cp, ctx.quick):
            mode = exchange_mode(c)
            errors = {op: out["probe"][op][c.dtype] for op in NEEDS[mode] if out["probe"][op][c.dtype] != "ok"}
            (skipped if errors else todo).append((c, mode, errors))
        out["planned"] = len(todo)
        ctx.save()
        for mode in sorted({m for _, m, _ in skipped}):
            mine = [(c, e) for c, m, e in skipped if m == mode]
            example = session.run_one(mine[0][0]) if time.monotonic() < finish_by else None
            out["unsupported"][mode] = {
                "collective_errors": mine[0][1], "cases_not_run": len(mine),
                "example": None if example is None else _short(example),
            }
        for i in range(0, len(todo), CHUNK):
            if time.monotonic() >= finish_by:
                out["stopped"] = f"step deadline near: {out['run']} of {len(todo)} cases run"
                break
            for r in session.run([c for c, _, _ in todo[i:i + CHUNK]]):
                out["run"] += 1
                out["passed"] += r.ok
                ctx.data["failed_cases"] = ctx.data.get("failed_cases", 0) + (not r.ok)
                ex = out["by_exchange"].setdefault(r.case.exchange or "auto", {"run": 0, "passed": 0})
                ex["run"] += 1
                ex["passed"] += r.ok
                if not r.ok and len(out["failed"]) < 10:
                    out["failed"].append(_short(r))
            out["seconds"]["cases"] = time.monotonic() - t0 - out["seconds"]["pool_start"] - out["seconds"]["probe"]
            ctx.save()
        try:  # what ran in the ranks: flash-attn's and fla's calls (real or emulated)
            per_rank = pool.run(emulate.calls, timeout=30, name="calls")
            out["calls_per_rank"] = {name: [r.get(name, 0) for r in per_rank] for name in ("flash_attn_varlen_func", "chunk_gated_delta_rule")}
        except PoolError as exc:
            out["calls_per_rank"] = f"unknown: {exc}"[:300]


def run(ctx: StepContext) -> str:
    gpus = torch.cuda.device_count() if ctx.device == "cuda" else 0
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # the ranks inherit it: fla's float32 as in step mixers
    ctx.data["triton_f32_default"] = os.environ["TRITON_F32_DEFAULT"]
    ctx.data["cps"] = {}
    ctx.data["failed_cases"] = 0
    for i, cp in enumerate(CPS):
        if ctx.time_left() <= 0:
            ctx.data["stopped"] = f"step deadline near: CP {cp} not run"
            break
        finish_by = time.monotonic() + ctx.time_left() / (len(CPS) - i)  # an equal share of what is left
        backend = "nccl" if ctx.device == "cuda" and gpus >= cp else "gloo"
        if ctx.device == "cuda" and backend == "gloo":
            ctx.data["why_gloo"] = (f"{gpus} GPU(s) for {cp} ranks: NCCL cannot run several ranks on one GPU; the ranks share "
                                    "it, their collectives staged through host memory over gloo")
        _run_cp(ctx, cp, backend, finish_by)
        ctx.save()
    per_cp = ctx.data["cps"].values()
    if any(d["failed"] or d["run"] > d["passed"] for d in per_cp):
        return "fail"
    if any("error" in d for d in per_cp):
        return "error"
    if "stopped" in ctx.data or any("stopped" in d for d in per_cp):
        return "incomplete"
    return "pass" if any(d["run"] for d in per_cp) else "unsupported"


def summarize(d: dict) -> list[str]:
    lines = [d["why_gloo"]] if d.get("why_gloo") else []
    for cp, s in d.get("cps", {}).items():
        bad = [f"{op} ({', '.join(f'{k}: {v}' for k, v in by.items() if v != 'ok')})"
               for op, by in s["probe"].items() if any(v != "ok" for v in by.values())]
        took = ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in s.get("seconds", {}).items())
        calls = s.get("calls_per_rank")
        calls = (f"; flash-attn calls per rank {calls['flash_attn_varlen_func']}, fla {calls['chunk_gated_delta_rule']}"
                 if isinstance(calls, dict) else "")
        lines.append(f"CP {cp} over {s['backend']} ({s['device']} tensors, collectives {s.get('collectives', '?')}): "
                     f"{s['passed']}/{s['run']} cases passed of {s['planned']} runnable ({took}); collectives failing: "
                     f"{'; '.join(bad) or 'none'}{calls}" + (f"; {s['stopped']}" if s.get("stopped") else ""))
        for mode, u in s["unsupported"].items():
            ex = u["example"]
            lines.append(f"  exchange {mode} unsupported here: {u['cases_not_run']} cases not run"
                         + (f"; e.g. {ex['label']}: {ex['status']}: {ex['error']}" if ex else ""))
        lines += [f"  FAILED {f['label']}: {f['status']}\n    {f['reproduce']}" for f in s["failed"]]
        if s.get("error"):
            lines.append(f"  ERROR {s['error'].strip().splitlines()[-1]}")
    return lines
