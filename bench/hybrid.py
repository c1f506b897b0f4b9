"""Benchmark of a Gated DeltaNet layer under CP (``python -m bench --only hybrid``): its short convolution and
its gated delta rule, from the convolution's input ``mixed [1, L, C]`` and the gates ``g, beta [1, L, Hv]`` to
the recurrence's output ``[1, L, Hv, V]``, forward and backward, over long-tail packed documents.

Three ways to run the layer on a CP group (each rank holds its contiguous ``L = S / W`` rows):

- ``blockdiag``: :func:`blockdiag_dist.mixers.causal_conv` and :func:`~blockdiag_dist.mixers.gated_delta_rule`
  (the convolution's history and the summaries of continuing documents, needed-only);
- ``allgather``: every rank all-gathers the layer's inputs (what NeMo Automodel's load-balanced path does with
  the hidden states), runs the layer per document over the whole sequence and keeps its rows; backward
  reduce-scatters the gradients;
- ``a2a_heads``: head-parallel (Megatron's): an all-to-all turns sequence shards into head shards (each rank the
  whole sequence for ``Hv / W`` value heads and ``Hk / W`` key heads), the layer runs per document, a second
  all-to-all brings the outputs back; needs the heads divisible by ``W``.

A Mamba2 layer (Nemotron-H's: the convolution of ``xBC`` and the SSD, :data:`SSD_LAYER`) gives one more figure,
bytes only: what each rank receives per forward under blockdiag (:func:`ssd_bytes`; the all-gather baseline
would receive the rank's other ranks' ``xBC`` and ``dt``). A Kimi Delta Attention layer (Kimi Linear's: the
convolution of ``q, k, v`` and KDA with its decay per key channel, :data:`KDA_LAYER`) and a Mamba1 layer (Jamba's: the
convolution of ``x`` and the selective scan, :data:`SCAN_LAYER`; its summaries are ``I * N`` per continuing piece,
twice that for a piece that itself continues its document) give their bytes (:func:`kda_bytes`, :func:`scan_bytes`)
and their CP 2 step against the single device, timed in the same rounds as the Gated DeltaNet layer's
(:func:`mixer_cp_times`, :func:`mixer_single_times`; blockdiag only). A lightning-attention layer (MiniMax's core: a
fixed decay per head, no convolution, :data:`LIGHTNING_LAYER`) gives its bytes (:func:`lightning_bytes`):
``H * D * D`` per continuing piece, plus ``H`` for the transition of a piece that itself continues its document.

Figures: bytes each rank receives per forward (blockdiag's: histories and summaries, flat in S), the CP 2 step
against the single-device layer on the same cores (one process with both threads), and each rank's peak memory
at CP 4 against a quarter of the single-device layer's (each in a fresh process: its resident high-water mark,
reset once the step's plans and inputs exist, minus its RSS then; :mod:`bench.memory` says why not ``ru_maxrss``).

Shape legend: S sequence, W CP size, L = S / W, C = 2 Hk K + Hv V channels, Hk / Hv key / value heads.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx
from blockdiag_dist.exchange import TrafficLog, a2a_kv, allgather_kv
from blockdiag_dist.mixers import (causal_conv, gated_delta_rule, kimi_delta_attention, lightning_attention, plan_recurrence,
                                   selective_scan, ssd)
from blockdiag_dist.plan import plan_step
from verify.pool import WorkerPool, worker_info

from .memory import peak_bytes, reset_peak, rss_bytes

from verify.workloads import layout_of, long_tail

__all__ = ["HK", "HV", "K", "KDA_LAYER", "LIGHTNING_LAYER", "MIXER_LAYERS", "SCAN_LAYER", "SSD_LAYER", "V", "WIDTH",
           "bench_hybrid", "kda_bytes", "kda_plan_bytes", "lightning_bytes", "lightning_plan_bytes", "mixer_cp_times",
           "mixer_output", "mixer_single_times", "scan_bytes", "scan_plan_bytes",
           "ssd_bytes", "ssd_plan_bytes"]

HK, HV, K, V, WIDTH = 4, 8, 32, 32, 4
C = 2 * HK * K + HV * V
METHODS = ("blockdiag", "allgather", "a2a_heads")
SSD_LAYER = {"H": 8, "Dh": 32, "G": 2, "N": 32}  # Mamba2 heads, head dim, groups, state size (width WIDTH)
KDA_LAYER = {"H": 8, "K": 32}  # KDA heads and head dim (q, k, v and the decay per key channel; width WIDTH)
SCAN_LAYER = {"I": 128, "N": 16}  # Mamba1 channels and state size (Jamba's N; width WIDTH)
MIXER_LAYERS = ("kda", "mamba1")  # the layers timed beside the Gated DeltaNet one (blockdiag at CP 2 vs single device)
LIGHTNING_LAYER = {"H": 8, "D": 64}  # lightning-attention heads and head dim (MiniMax-Text-01: 64 heads of 128)


def _ids(S: int, seed: int) -> torch.Tensor:
    return layout_of(long_tail(S, seed)).doc_ids


def _layer(mixed, g, beta, weight, state):
    """The layer on one state's rows: ``mixed [B, L, C]``, ``g, beta [B, L, Hv]`` -> ``[B, L, Hv, V]``."""
    B, L, _ = mixed.shape
    hk = (mixed.shape[-1] - g.shape[-1] * V) // (2 * K)
    x = causal_conv(mixed, weight, None, "silu", state=state)
    q, k, v = torch.split(x, [hk * K, hk * K, g.shape[-1] * V], dim=-1)
    return gated_delta_rule(q.reshape(B, L, hk, K), k.reshape(B, L, hk, K), v.reshape(B, L, -1, V), g, beta, state=state)


def _single_state(ids: torch.Tensor):
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.zeros(*ids.shape, 1), "_packed_seq_ids": ids},
                                             expect_attention=False, conv_widths=[WIDTH])
    return ctx.state


def _head_channels(rank: int, world: int) -> torch.Tensor:
    """The channels of ``mixed`` that rank ``rank``'s heads read: its q, k and v heads."""
    hk, hv = HK // world, HV // world
    q = torch.arange(rank * hk * K, (rank + 1) * hk * K)
    return torch.cat([q, q + HK * K, 2 * HK * K + torch.arange(rank * hv * V, (rank + 1) * hv * V)])


class _Step:
    """One method's forward + backward on this rank's rows (inputs built once, grads recomputed every call)."""

    def __init__(self, method: str, S: int, seed: int, mesh, dtype: torch.dtype = torch.float32) -> None:
        self.method = method
        ids = _ids(S, seed)
        group = None if mesh is None else mesh.get_group()
        world = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        ctx, _ = make_cp_blockdiag_batch_and_ctx(mesh, None, {"inputs_embeds": torch.zeros(1, S, 1), "_packed_seq_ids": ids},
                                                 expect_attention=False, conv_widths=[WIDTH])
        self.state, self.group, self.world, self.rank = ctx.state, group, world, rank
        L = ctx.state.local_len
        gen = torch.Generator().manual_seed(seed * 100 + rank)
        self.mixed = torch.randn(1, L, C, generator=gen, dtype=dtype).requires_grad_()
        self.g = (-torch.rand(1, L, HV, generator=gen, dtype=dtype)).requires_grad_()
        self.beta = torch.rand(1, L, HV, generator=gen, dtype=dtype).requires_grad_()
        self.grad_out = torch.randn(1, L, HV, V, generator=gen, dtype=dtype)
        shared = torch.Generator().manual_seed(seed)  # a parameter: the same on every rank
        self.weight = (torch.randn(C, WIDTH, generator=shared, dtype=dtype) / WIDTH).requires_grad_()
        self.traffic = TrafficLog()
        if method != "blockdiag":  # the whole (padded) sequence, on one rank
            self.full = _single_state(torch.nn.functional.pad(ids, (0, world * L - S)))

    def forward(self):
        if self.method == "blockdiag":
            return _layer(self.mixed, self.g, self.beta, self.weight, self.state)
        L, W = self.mixed.shape[1], self.world
        if self.method == "allgather":
            tok = torch.cat([self.mixed[0], self.g[0], self.beta[0]], dim=1)  # [L, C + 2 Hv]
            full = tok if W == 1 else allgather_kv(tok, self.group, W, self.traffic)  # [W * L, F], global order
            mixed, g, beta = torch.split(full[None], [C, HV, HV], dim=-1)
            out = _layer(mixed, g, beta, self.weight, self.full)
            return out[:, self.rank * L:(self.rank + 1) * L]
        # a2a_heads: sequence shards -> head shards -> sequence shards
        hv = HV // W
        chans = [_head_channels(d, W) for d in range(W)]
        tok = torch.cat([torch.cat([self.mixed[0][:, chans[d]], self.g[0][:, d * hv:(d + 1) * hv],
                                    self.beta[0][:, d * hv:(d + 1) * hv]], 1) for d in range(W)])  # [W * L, F_d]
        rows = torch.arange(W * L)
        mine = a2a_kv(tok, rows, [L] * W, [L] * W, self.group, self.traffic) if W > 1 else tok  # [S, F_d]
        c = chans[self.rank].numel()
        mixed, g, beta = torch.split(mine[None], [c, hv, hv], dim=-1)
        out = _layer(mixed, g, beta, self.weight[chans[self.rank]], self.full)  # [1, S, hv, V]
        back = a2a_kv(out[0].reshape(W * L, hv * V), rows, [L] * W, [L] * W, self.group, self.traffic) if W > 1 else out[0].reshape(W * L, -1)
        return back.view(W, L, hv, V).permute(1, 0, 2, 3).reshape(1, L, HV, V)

    def __call__(self) -> None:
        out = self.forward()
        torch.autograd.grad(out, (self.mixed, self.g, self.beta, self.weight), self.grad_out)

    def recv_bytes(self) -> int:
        """Bytes this rank received in its last forward."""
        log = self.state.mixer_traffic if self.method == "blockdiag" else self.traffic
        return sum(e.recv_bytes for e in log.entries if e.phase == "forward")


def _timed(steps: dict[str, _Step], reps: int, barrier: bool) -> dict[str, float]:
    times: dict[str, list[float]] = {n: [] for n in steps}
    for rep in range(reps + 1):
        for name, step in steps.items():
            if barrier:
                dist.barrier()
            t0 = time.perf_counter()
            step()
            if barrier:
                dist.barrier()
            if rep:
                times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def cp_times(S: int, seed: int, methods: tuple[str, ...], reps: int) -> dict:
    """On every rank of a pool: each method's median step (between barriers: the slowest rank's), and the bytes
    this rank received in one forward."""
    mesh = worker_info()["cp_mesh"]
    torch.set_num_threads(1)
    steps = {m: _Step(m, S, seed, mesh) for m in methods}
    for step in steps.values():  # one step each, alone, to count the bytes of one forward
        step.state.mixer_traffic.clear()
        step.traffic.clear()
        step()
    bytes_ = {m: s.recv_bytes() for m, s in steps.items()}
    return {"seconds": _timed(steps, reps, barrier=True), "recv_bytes": bytes_, "local_len": steps[methods[0]].state.local_len}


def single_times(S: int, seed: int, reps: int, threads: int) -> float:
    torch.set_num_threads(threads)
    return _timed({"single": _Step("blockdiag", S, seed, None)}, reps, barrier=False)["single"]


def peak_memory(S: int, seed: int, method: str = "blockdiag") -> dict:
    """Peak resident memory of one step in a fresh process (a pool rank, or the single device with no pool): from
    the RSS once the step's plans and inputs exist to the process's high-water mark after forward and backward,
    reset in between (the plans' own transient peak, if higher, is reported as ``setup_peak_bytes``)."""
    env = worker_info()
    torch.set_num_threads(1)
    start = rss_bytes()
    reset_peak()
    step = _Step(method, S, seed, env.get("cp_mesh") if env else None)
    before = rss_bytes()
    setup_peak = peak_bytes()
    if not reset_peak():
        raise RuntimeError("expected /proc/self/clear_refs to reset the resident high-water mark (Linux), got none: "
                           "the step's peak cannot be told from the process's")
    t0 = time.perf_counter()
    step()
    peak = peak_bytes()
    return {"peak_increase_bytes": peak - before, "setup_bytes": before - start, "setup_peak_bytes": setup_peak - start,
            "step_above_setup_peak": peak > setup_peak, "seconds": time.perf_counter() - t0}


def _single_memory(S: int, seed: int, timeout: float) -> dict:
    with WorkerPool(1, collective_timeout=timeout) as pool:  # a fresh process, as the ranks are
        return pool.run(peak_memory, args=(S, seed), timeout=timeout, name=f"single memory S{S}")[0]


def summary_bytes(plan, rank: int) -> int:
    """The summaries' bytes rank ``rank`` receives per forward by the step plan ``plan`` (float32)."""
    from blockdiag_dist.mixers import plan_recurrence

    rec = plan_recurrence(plan.documents, rank)
    return 4 * sum(rec.recv_splits(HV * K * V, HV * K * K)) if rec.any_traffic else 0


def _ssd_channels() -> int:
    m = SSD_LAYER
    return m["H"] * m["Dh"] + 2 * m["G"] * m["N"]


def ssd_bytes(S: int, seed: int, dtype: str = "float32") -> dict:
    """On every rank: one forward of the Mamba2 layer from ``xBC [1, L, I + 2 G N]`` and ``dt [1, L, H]`` (the
    convolution, then the SSD) under blockdiag, contiguous shards; the bytes this rank received."""
    m, dt_ = SSD_LAYER, getattr(torch, dtype)
    mesh = worker_info().get("cp_mesh")
    ids = _ids(S, seed)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(mesh, None, {"inputs_embeds": torch.zeros(1, S, 1), "_packed_seq_ids": ids},
                                             expect_attention=False, conv_widths=[WIDTH])
    state, L, Cn = ctx.state, ctx.state.local_len, _ssd_channels()
    gen = torch.Generator().manual_seed(seed * 100 + state.rank)
    xbc, dt = torch.randn(1, L, Cn, generator=gen, dtype=dt_), torch.rand(1, L, m["H"], generator=gen, dtype=dt_) * 0.1
    weight = torch.randn(Cn, WIDTH, generator=torch.Generator().manual_seed(seed), dtype=dt_) / WIDTH
    A = -torch.arange(1, m["H"] + 1, dtype=dt_)
    state.mixer_traffic.clear()
    x, Bm, Cm = causal_conv(xbc, weight, None, "silu", state=state).split([m["H"] * m["Dh"], m["G"] * m["N"], m["G"] * m["N"]], -1)
    ssd(x.reshape(1, L, m["H"], m["Dh"]), dt, A, Bm.reshape(1, L, m["G"], m["N"]), Cm.reshape(1, L, m["G"], m["N"]), state=state)
    return {"recv_bytes": sum(e.recv_bytes for e in state.mixer_traffic.entries if e.phase == "forward")}


def ssd_plan_bytes(plan, rank: int, element: int = 4) -> dict:
    """The bytes rank ``rank`` receives per forward of the Mamba2 layer by the step plan: the SSD's summaries
    (``H * Dh * N``, plus ``H`` for a piece that itself continues its document) and the convolution's history."""
    m = SSD_LAYER
    rec = plan_recurrence(plan.documents, rank)
    summaries = element * sum(rec.recv_splits(m["H"] * m["Dh"] * m["N"], m["H"])) if rec.any_traffic else 0
    return {"summaries": summaries, "history": plan.exchange(WIDTH - 1).needed_tokens()[rank] * _ssd_channels() * element}


class _MixerStep:
    """blockdiag's forward + backward of the KDA layer (:data:`KDA_LAYER`: the convolution of ``q, k, v``, then KDA
    with its decay per key channel), the Mamba1 layer (:data:`SCAN_LAYER`: the convolution of ``x``, then the
    selective scan) or the lightning-attention layer (:data:`LIGHTNING_LAYER`: MiniMax's fixed slopes, no
    convolution) on this rank's rows, contiguous shards (inputs built once, grads recomputed every call); with
    ``mesh=None`` the single-device layer over the whole sequence. Every rank draws the whole sequence's inputs from
    ``seed`` and keeps its rows: the ranks' outputs together are the single device's (:func:`mixer_output`)."""

    def __init__(self, layer: str, S: int, seed: int, mesh, dtype: torch.dtype = torch.float32) -> None:
        if layer not in MIXER_LAYERS + ("lightning",):
            raise ValueError(f"layer: expected one of {MIXER_LAYERS + ('lightning',)}, got {layer!r}")
        self.layer = layer
        ctx, _ = make_cp_blockdiag_batch_and_ctx(mesh, None, {"inputs_embeds": torch.zeros(1, S, 1),
                                                              "_packed_seq_ids": _ids(S, seed)},
                                                 expect_attention=False, conv_widths=[WIDTH])
        self.state = state = ctx.state
        W, L, r = state.world, state.local_len, state.rank
        gen = torch.Generator().manual_seed(seed)  # the whole sequence's, on every rank: this rank's rows of it

        def rows(x: torch.Tensor) -> torch.Tensor:  # [1, S, ...] -> this rank's [1, L, ...] (padding rows 0)
            return torch.cat([x, x.new_zeros(1, W * L - S, *x.shape[2:])], 1)[:, r * L:(r + 1) * L].contiguous()

        if layer == "kda":
            H, Kd = KDA_LAYER["H"], KDA_LAYER["K"]
            self.inputs = {"mixed": rows(torch.randn(1, S, 3 * H * Kd, generator=gen, dtype=dtype)),
                           "g": rows(-torch.rand(1, S, H, Kd, generator=gen, dtype=dtype)),
                           "beta": rows(torch.rand(1, S, H, generator=gen, dtype=dtype)),
                           "weight": torch.randn(3 * H * Kd, WIDTH, generator=gen, dtype=dtype) / WIDTH}
            self.grad_out = rows(torch.randn(1, S, H, Kd, generator=gen, dtype=dtype))
        elif layer == "lightning":
            H, D = LIGHTNING_LAYER["H"], LIGHTNING_LAYER["D"]
            self.inputs = {n: rows(torch.randn(1, S, H, D, generator=gen, dtype=dtype)) for n in ("q", "k", "v")}
            self.slope = 2.0 ** (-8.0 * torch.arange(1, H + 1, dtype=dtype) / H)  # MiniMax's, a constant
            self.grad_out = rows(torch.randn(1, S, H, D, generator=gen, dtype=dtype))
        else:
            I, N = SCAN_LAYER["I"], SCAN_LAYER["N"]
            self.inputs = {"x": rows(torch.randn(1, S, I, generator=gen, dtype=dtype)),
                           "dt": rows(torch.rand(1, S, I, generator=gen, dtype=dtype) * 0.1),
                           "B": rows(torch.randn(1, S, 1, N, generator=gen, dtype=dtype)),
                           "C": rows(torch.randn(1, S, 1, N, generator=gen, dtype=dtype)),
                           "weight": torch.randn(I, WIDTH, generator=gen, dtype=dtype) / WIDTH,
                           "A": -torch.arange(1, N + 1, dtype=dtype).expand(I, N).contiguous()}
            self.grad_out = rows(torch.randn(1, S, I, generator=gen, dtype=dtype))
        for t in self.inputs.values():
            t.requires_grad_()

    def forward(self) -> torch.Tensor:
        t, state = self.inputs, self.state
        L = state.local_len
        if self.layer == "kda":
            H, Kd = KDA_LAYER["H"], KDA_LAYER["K"]
            q, k, v = causal_conv(t["mixed"], t["weight"], None, "silu", state=state).reshape(1, L, 3, H, Kd).unbind(2)
            return kimi_delta_attention(q, k, v, t["g"], t["beta"], state=state)
        if self.layer == "lightning":
            return lightning_attention(t["q"], t["k"], t["v"], self.slope, state=state)
        x = causal_conv(t["x"], t["weight"], None, "silu", state=state)
        return selective_scan(x, t["dt"], t["A"], t["B"], t["C"], state=state)

    def __call__(self) -> None:
        torch.autograd.grad(self.forward(), tuple(self.inputs.values()), self.grad_out)

    def forward_bytes(self) -> int:
        """Bytes this rank receives in one forward (no autograd)."""
        self.state.mixer_traffic.clear()
        with torch.no_grad():
            self.forward()
        return sum(e.recv_bytes for e in self.state.mixer_traffic.entries if e.phase == "forward")


def mixer_output(layer: str, S: int, seed: int, dtype: str = "float64") -> torch.Tensor:
    """The layer's forward output on this rank's rows (a pool rank) or on the whole sequence (no pool)."""
    mesh = (worker_info() or {}).get("cp_mesh")
    with torch.no_grad():
        return _MixerStep(layer, S, seed, mesh, getattr(torch, dtype)).forward()


def mixer_cp_times(S: int, seed: int, layers: tuple[str, ...], reps: int) -> dict:
    """On every rank of a pool: each of ``layers``' (:data:`MIXER_LAYERS`) median step under blockdiag (between
    barriers: the slowest rank's)."""
    torch.set_num_threads(1)
    mesh = worker_info()["cp_mesh"]
    return {"seconds": _timed({m: _MixerStep(m, S, seed, mesh) for m in layers}, reps, barrier=True)}


def mixer_single_times(S: int, seed: int, layers: tuple[str, ...], reps: int, threads: int) -> dict[str, float]:
    """Each of ``layers``' median step on one device (this process, ``threads`` threads)."""
    torch.set_num_threads(threads)
    return _timed({m: _MixerStep(m, S, seed, None) for m in layers}, reps, barrier=False)


def kda_bytes(S: int, seed: int, dtype: str = "float32") -> dict:
    """On every rank: one forward of the KDA layer from ``mixed [1, L, 3 H K]`` (q, k, v before the convolution),
    the decay ``g [1, L, H, K]`` and ``beta [1, L, H]`` under blockdiag, contiguous shards; the bytes received."""
    return {"recv_bytes": _MixerStep("kda", S, seed, worker_info().get("cp_mesh"), getattr(torch, dtype)).forward_bytes()}


def kda_plan_bytes(plan, rank: int, element: int = 4) -> dict:
    """The bytes rank ``rank`` receives per forward of the KDA layer by the step plan: the summaries (``H * K * K``
    per head and continuing piece, plus ``H * K * K`` for the transition of one that itself continues) and the
    convolution's history."""
    H, Kd = KDA_LAYER["H"], KDA_LAYER["K"]
    rec = plan_recurrence(plan.documents, rank)
    summaries = element * sum(rec.recv_splits(H * Kd * Kd, H * Kd * Kd)) if rec.any_traffic else 0
    return {"summaries": summaries, "history": plan.exchange(WIDTH - 1).needed_tokens()[rank] * 3 * H * Kd * element}


def scan_bytes(S: int, seed: int, dtype: str = "float32") -> dict:
    """On every rank: one forward (no autograd) of the Mamba1 layer from ``x [1, L, I]``, ``dt [1, L, I]``, ``B, C
    [1, L, 1, N]`` (the convolution of ``x``, then the selective scan) under blockdiag, contiguous shards; the bytes
    this rank received."""
    return {"recv_bytes": _MixerStep("mamba1", S, seed, worker_info().get("cp_mesh"), getattr(torch, dtype)).forward_bytes()}


def scan_plan_bytes(plan, rank: int, element: int = 4) -> dict:
    """The bytes rank ``rank`` receives per forward of the Mamba1 layer by the step plan: the selective scan's
    summaries (``I * N``, twice for a piece that itself continues its document) and the convolution's history."""
    m = SCAN_LAYER
    rec = plan_recurrence(plan.documents, rank)
    IN = m["I"] * m["N"]
    summaries = element * sum(rec.recv_splits(IN, IN)) if rec.any_traffic else 0
    return {"summaries": summaries, "history": plan.exchange(WIDTH - 1).needed_tokens()[rank] * m["I"] * element}


def lightning_bytes(S: int, seed: int, dtype: str = "float32") -> dict:
    """On every rank: one forward (no autograd) of lightning attention from ``q, k, v [1, L, H, D]`` and MiniMax's
    slopes under blockdiag, contiguous shards; the bytes this rank received."""
    return {"recv_bytes": _MixerStep("lightning", S, seed, worker_info().get("cp_mesh"), getattr(torch, dtype)).forward_bytes()}


def lightning_plan_bytes(plan, rank: int, element: int = 4) -> dict:
    """The bytes rank ``rank`` receives per forward of lightning attention by the step plan: ``H * D * D`` per
    continuing piece, plus ``H`` (the transition ``exp(-slope n)``) for a piece that itself continues its document;
    no history (no convolution)."""
    H, D = LIGHTNING_LAYER["H"], LIGHTNING_LAYER["D"]
    rec = plan_recurrence(plan.documents, rank)
    return {"summaries": element * sum(rec.recv_splits(H * D * D, H)) if rec.any_traffic else 0, "history": 0}


def bench_hybrid(sizes=(8192, 32768), *, reps: int = 2, mem_S: int = 32768, mem_cp: int = 4, seed: int = 0,
                 rounds: int = 2, timeout: float = 3000.0, mixer_sizes=(8192,), console=None) -> dict:
    """Every figure of the hybrid section (see the module docstring); the KDA and Mamba1 steps are timed at the
    sizes of ``sizes`` also in ``mixer_sizes`` (the single-device Mamba1 step at 32k holds several GB: its doubling
    scan keeps ``S x I x N`` states per level for the backward)."""
    say = console.print if console is not None else print
    rows = []
    with WorkerPool(2, collective_timeout=timeout) as pool:
        for S in sizes:
            t0 = time.perf_counter()
            cp, single, single1, mix_cp, mix_single, mix_single1 = [], [], [], [], [], []
            mixer_seconds = 0.0
            for _ in range(rounds):  # alternate CP 2 and single device, so that the machine's drift hits both
                cp.append(pool.run(cp_times, args=(S, seed, METHODS, reps), timeout=timeout, name=f"hybrid cp2 S{S}"))
                single.append(single_times(S, seed, reps, threads=2))
                single1.append(single_times(S, seed, reps, threads=1))
                if S not in mixer_sizes:
                    continue
                t1 = time.perf_counter()
                mix_cp.append(pool.run(mixer_cp_times, args=(S, seed, MIXER_LAYERS, reps), timeout=timeout,
                                       name=f"hybrid kda/mamba1 cp2 S{S}")[0]["seconds"])
                mix_single.append(mixer_single_times(S, seed, MIXER_LAYERS, reps, threads=2))
                mix_single1.append(mixer_single_times(S, seed, MIXER_LAYERS, reps, threads=1))
                mixer_seconds += time.perf_counter() - t1
            seconds = {m: statistics.median(r[0]["seconds"][m] for r in cp) for m in METHODS}
            one, one1 = statistics.median(single), statistics.median(single1)
            plan = plan_step(_ids(S, seed), 2, "contiguous")
            row = {
                "S": S, "cp": 2, "docs": len(long_tail(S, seed)), "single_seconds": one, "single_1thread_seconds": one1,
                "over_half_single_1thread": seconds["blockdiag"] / (one1 / 2),
                "seconds": seconds, "over_single": {m: seconds[m] / one for m in METHODS},
                "recv_bytes_per_rank": {m: [rk["recv_bytes"][m] for rk in cp[0]] for m in METHODS},
                "summary_bytes_per_rank": [summary_bytes(plan, r) for r in range(2)],
                "history_bytes_per_rank": [plan.exchange(WIDTH - 1).needed_tokens()[r] * C * 4 for r in range(2)],
                "section_seconds": time.perf_counter() - t0, "mixer_step_seconds": mixer_seconds,
            }
            ssd_recv = pool.run(ssd_bytes, args=(S, seed), timeout=timeout, name=f"ssd bytes S{S}")
            row["ssd"] = {"layer": SSD_LAYER, "recv_bytes_per_rank": [r["recv_bytes"] for r in ssd_recv],
                          "plan_bytes_per_rank": [ssd_plan_bytes(plan, r) for r in range(2)],
                          "allgather_bytes_per_rank": (S // 2) * (_ssd_channels() + SSD_LAYER["H"]) * 4}
            kda_recv = pool.run(kda_bytes, args=(S, seed), timeout=timeout, name=f"kda bytes S{S}")
            H, Kd = KDA_LAYER["H"], KDA_LAYER["K"]
            row["kda"] = {"layer": KDA_LAYER, "recv_bytes_per_rank": [r["recv_bytes"] for r in kda_recv],
                          "plan_bytes_per_rank": [kda_plan_bytes(plan, r) for r in range(2)],
                          "allgather_bytes_per_rank": (S // 2) * (3 * H * Kd + H * Kd + H) * 4}
            scan_recv = pool.run(scan_bytes, args=(S, seed), timeout=timeout, name=f"scan bytes S{S}")
            row["mamba1"] = {"layer": SCAN_LAYER, "recv_bytes_per_rank": [r["recv_bytes"] for r in scan_recv],
                             "plan_bytes_per_rank": [scan_plan_bytes(plan, r) for r in range(2)],
                             "allgather_bytes_per_rank": (S // 2) * (2 * SCAN_LAYER["I"] + 2 * SCAN_LAYER["N"]) * 4}
            light_recv = pool.run(lightning_bytes, args=(S, seed), timeout=timeout, name=f"lightning bytes S{S}")
            H, D = LIGHTNING_LAYER["H"], LIGHTNING_LAYER["D"]
            row["lightning"] = {"layer": LIGHTNING_LAYER, "recv_bytes_per_rank": [r["recv_bytes"] for r in light_recv],
                                "plan_bytes_per_rank": [lightning_plan_bytes(plan, r) for r in range(2)],
                                "allgather_bytes_per_rank": (S // 2) * 3 * H * D * 4}
            for m in MIXER_LAYERS if mix_cp else ():  # the KDA and Mamba1 layers' steps, timed in the same rounds
                t_cp, t_one, t_one1 = (statistics.median(r[m] for r in runs) for runs in (mix_cp, mix_single, mix_single1))
                row["kda" if m == "kda" else "mamba1"]["step"] = {
                    "cp2_seconds": t_cp, "single_seconds": t_one, "single_1thread_seconds": t_one1,
                    "over_single": t_cp / t_one, "over_half_single_1thread": t_cp / (t_one1 / 2)}
            rows.append(row)
            say(f"bench hybrid: S={S}: CP 2 / single = {row['over_single']['blockdiag']:.3f} "
                f"(single {one:.2f} s), bytes per rank {row['recv_bytes_per_rank']['blockdiag']}")
    with WorkerPool(mem_cp, collective_timeout=timeout) as pool:
        per_rank = pool.run(peak_memory, args=(mem_S, seed), timeout=timeout, name=f"hybrid memory cp{mem_cp}")
    single = _single_memory(mem_S, seed, timeout)
    memory = {
        "S": mem_S, "cp": mem_cp, "peak_increase_bytes_per_rank": [r["peak_increase_bytes"] for r in per_rank],
        "single_peak_increase_bytes": single["peak_increase_bytes"],
        "max_over_quarter_single": max(r["peak_increase_bytes"] for r in per_rank) / (single["peak_increase_bytes"] / mem_cp),
        "single_seconds": single["seconds"], "cp_seconds": max(r["seconds"] for r in per_rank),
    }
    return {"layer": {"Hk": HK, "Hv": HV, "K": K, "V": V, "width": WIDTH, "channels": C, "dtype": "float32"},
            "docs": "long-tail, <= 2048 tokens", "rows": rows, "memory": memory,
            "goals": {"cp2_over_single": 1.10, "memory_over_quarter_single": 1.2}}


def baseline_agreement(S: int, seed: int, dtype: str = "float32") -> dict:
    """On every rank: the largest difference between the baselines' outputs and blockdiag's (the same layer
    computed three ways), and the bytes each received in one forward."""
    mesh = worker_info()["cp_mesh"]
    outs, received = {}, {}
    for m in METHODS:
        step = _Step(m, S, seed, mesh, getattr(torch, dtype))
        step.state.mixer_traffic.clear()
        outs[m] = step.forward().detach()
        received[m] = step.recv_bytes()
    return {"max_diff": {m: (outs[m] - outs["blockdiag"]).abs().max().item() for m in METHODS}, "recv_bytes": received}
