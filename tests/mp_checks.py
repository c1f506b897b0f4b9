"""Functions that tests run on every rank of a verify.pool.WorkerPool (importable by the spawned workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from blockdiag_dist import PlanMismatchError, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from verify.pool import worker_info


def worker_origin(name: str) -> tuple[int, str | None]:
    """This worker's OS parent and the value of the environment variable ``name``."""
    import os

    return os.getppid(), os.environ.get(name)


def worker_cores() -> list[int]:
    """The cores this worker may run on."""
    import os

    return sorted(os.sched_getaffinity(0))


def _batch(ids: torch.Tensor) -> dict:
    return {"inputs_embeds": torch.zeros(*ids.shape, 3), "_packed_seq_ids": ids}


class ClaimsFourRanks:
    """A mesh whose process group holds fewer ranks than its size() claims."""

    ndim = 1

    def size(self) -> int:
        return 4

    def get_group(self):
        return dist.group.WORLD


def mesh_size_mismatch() -> str:
    batch = _batch(torch.ones(1, 8, dtype=torch.long))
    try:
        make_cp_blockdiag_batch_and_ctx(ClaimsFourRanks(), None, batch)
    except ValueError as exc:
        assert "padding_mask" not in batch, "the batch was mutated before the error"
        return str(exc)
    raise AssertionError("no error for a mesh whose group size differs from its size")


def consensus_mismatch() -> str:
    """Rank 1 is given other doc ids than the others: with the consensus check on, every rank raises
    naming the disagreeing ranks, instead of entering mismatched collectives."""
    info = worker_info()
    ids = torch.tensor([[1, 1, 1, 1, 1, 1, 2, 2]])
    if info["rank"] == 1:
        ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2]])
    try:
        make_cp_blockdiag_batch_and_ctx(info["cp_mesh"], None, _batch(ids), check_consensus=True)
    except PlanMismatchError as exc:
        return str(exc)
    raise AssertionError("ranks with different plans were not detected")


def windows_agreed_at_once(differ: bool) -> dict:
    """The batch function plans two windows (three on rank 1 when ``differ``): with the consensus check on, it
    compares them all in one all-reduce; a rank listing another window makes every rank all-gather the
    fingerprints and raise, naming the windows. Returns the collectives the check ran, in order, and the error
    text (None when the batch function returned)."""
    import blockdiag_dist.state as state_module

    info = worker_info()
    ids = torch.tensor([[1] * 9 + [2] * 7])
    windows = [(4, 0), None] + ([(2, 0)] if differ and info["rank"] == 1 else [])
    calls = []
    gather, reduce = state_module.all_gather_tensor, dist.all_reduce
    state_module.all_gather_tensor = lambda *a, **k: (calls.append("all_gather"), gather(*a, **k))[1]
    dist.all_reduce = lambda *a, **k: (calls.append("all_reduce"), reduce(*a, **k))[1]
    try:
        make_cp_blockdiag_batch_and_ctx(info["cp_mesh"], None, _batch(ids), window_sizes=windows, check_consensus=True)
        error = None
    except PlanMismatchError as exc:
        error = str(exc)
    finally:
        state_module.all_gather_tensor, dist.all_reduce = gather, reduce
    return {"collectives": calls, "error": error}


def traffic_per_mode(mode: str) -> dict:
    """Bytes the exchange moved, forward and backward, for one step of a long document at this CP size."""
    info = worker_info()
    ids = torch.tensor([[1] * 10 + [2] * 7 + [0] * 3])
    ctx, batch = make_cp_blockdiag_batch_and_ctx(info["cp_mesh"], None, _batch(ids), kv_exchange=mode)
    g = torch.Generator().manual_seed(0)
    L = batch["inputs_embeds"].shape[1]
    q, k, v = (torch.randn(1, 2, L, 4, generator=g, requires_grad=True) for _ in range(3))
    with ctx():
        cp_blockdiag_sdpa(q, k, v, is_causal=True).sum().backward()
    state = ctx.state
    pos = batch["position_ids"][~batch["padding_mask"]] if "position_ids" in batch else state.positions[state.positions < ids.shape[1]]
    return {
        "mode": state.window_plan(-1).mode,
        "forward": state.traffic.totals("forward"),
        "backward": state.traffic.totals("backward"),
        "report": state.comm_report(-1, bytes_per_token=2 * 2 * 4 * 4),
        "arrived": [list(e.recv_by_source) for e in state.traffic.entries if e.phase == "forward"],
        "real_positions": [[0, p] for p in pos.tolist() if ids[0, p] != 0],
        "local_tokens": L,
    }


def case_with_wide_exchange(case_dict: dict, plant: bool) -> dict:
    """Run a verifier case on this rank; with ``plant``, the exchange plan is built for an unbounded window
    while the kernel keeps the case's window: outputs stay right, but more keys move than are needed."""
    from blockdiag_dist.plan import StepPlan
    from verify.runner import case_from_dict, check_case, impl_info

    info = worker_info()
    original = StepPlan.exchange
    if plant:
        StepPlan.exchange = lambda self, window_left: original(self, -1)
    try:
        return check_case(case_from_dict(case_dict), impl_info("blockdiag_dist"), info["cp_mesh"], info["rank"],
                          info["world"], torch.device("cpu"))
    finally:
        StepPlan.exchange = original


def gather_restores_order(layout: str) -> bool:
    """gather_sequence returns the full tensor in global order on every rank, for any layout."""
    from blockdiag_dist import gather_sequence

    info = worker_info()
    ids = torch.tensor([[1] * 9 + [2] * 3 + [0] * 2, [3] * 4 + [4] * 10])
    full = torch.arange(2 * 14 * 3, dtype=torch.float32).view(2, 14, 3)
    ctx, batch = make_cp_blockdiag_batch_and_ctx(info["cp_mesh"], None, {"inputs_embeds": full.clone(), "_packed_seq_ids": ids}, layout=layout, expect_attention=False)
    with ctx():
        got = gather_sequence(batch["inputs_embeds"] * 2)
    return torch.equal(got, full * 2)


def fingerprint(case_dict: dict) -> str:
    """sha256 of everything one CP step of a verifier case produces on this rank: outputs, grads of q, k, v,
    of inputs_embeds and of the projection weights (bitwise)."""
    import hashlib

    from verify.runner import _run_impl, case_from_dict, impl_info, make_inputs

    info = worker_info()
    case = case_from_dict(case_dict)
    run = _run_impl(case, impl_info("blockdiag_dist"), make_inputs(case), getattr(torch, case.dtype), torch.device("cpu"), info["cp_mesh"])
    res = run["res"]
    tensors = [res["out"], res["loss"], res["q"].grad, res["k"].grad, res["v"].grad, run["x"].grad, *(w.grad for w in run["ws"].values())]
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def consensus_by_default(check_consensus: bool | None) -> str:
    """Rank 1 is given other doc ids (a sampler bug). By default every rank raises PlanMismatchError naming
    the ranks; with the check turned off the batch function returns (and attention would be wrong)."""
    info = worker_info()
    ids = torch.tensor([[1, 1, 1, 1, 1, 1, 2, 2]])
    if info["rank"] == 1:
        ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2]])
    kwargs = {} if check_consensus is None else {"check_consensus": check_consensus}
    try:
        make_cp_blockdiag_batch_and_ctx(info["cp_mesh"], None, _batch(ids), **kwargs)
    except PlanMismatchError as exc:
        return str(exc)
    return "no error"


def lone_report_and_inplace_output() -> dict:
    """Rank 0 alone logs the comm report of a window not planned yet (no collective may happen: the others
    are not there); then every rank attends under that window and modifies the output in place. The last rank
    holds only padding. Returns this rank's max error of outputs and query grads against the reference."""
    from blockdiag_ref import reference_attention

    info = worker_info()
    ids = torch.tensor([[1] * 9 + [2] * 6 + [0] * 5])  # CP 4, L = 5: rank 3 holds only padding
    ctx, batch = make_cp_blockdiag_batch_and_ctx(info["cp_mesh"], None, _batch(ids), check_consensus=True)
    state = ctx.state
    report = state.comm_report(2) if info["rank"] == 0 else None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 4, generator=g, dtype=torch.float64) for _ in range(3))
    rows = state.positions.clamp(max=19)
    real = (state.positions < 20)[None, None, :, None]
    local = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    with ctx():
        out = cp_blockdiag_sdpa(*local, is_causal=True, window_size=(2, 0))
        out.mul_(2)  # an ordinary tensor on every rank, padding-only included
        (out * real).sum().backward()
    qf = q.clone().requires_grad_()
    ref = reference_attention(qf, k, v, ids, window_size=(2, 0)) * 2
    (ref[:, :, rows] * real).sum().backward()
    return {
        "report_mode": None if report is None else report["mode"],
        "out_err": float(((out - ref[:, :, rows]) * real).abs().max()),
        "dq_err": float(((local[0].grad - qf.grad[:, :, rows]) * real).abs().max()),
        "out_stride": tuple(out.stride()),
    }


def transformers_step_refusal(model_type: str, config_kwargs: dict) -> tuple[str, str]:
    """Build a tiny transformers model with blockdiag's attention and run one CP step on this rank's shard of
    three packed documents; return (exception class name, message), or ("", "") when nothing was refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from blockdiag_dist.integrations import pack_documents, register_transformers_attention

    info = worker_info()
    try:
        name = register_transformers_attention()
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **config_kwargs)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=name).double()
        batch = pack_documents([list(range(1, 21)), list(range(1, 13)), list(range(1, 17))], seq_len=48)
        ctx, batch = make_cp_blockdiag_batch_and_ctx(info.get("cp_mesh"), None, batch)
        with ctx():
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            out.logits.sum().backward()
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return type(e).__name__, str(e)
    return "", ""


def staged_collectives() -> list[str]:
    """Every collective the exchanges use, staged through host memory (verify.gpu.staging), values checked by
    the GPU check's own probes; the staging is removed afterwards (this pool serves other tests)."""
    from blockdiag_dist.exchange import allgather
    from verify.gpu import multirank, staging

    real = (dist.all_to_all_single, dist.batch_isend_irecv, allgather.all_gather_tensor)
    staging.install()
    try:
        assert dist.all_to_all_single is not real[0] and allgather.all_gather_tensor is not real[2], "not staged"
        for op in multirank.PROBES:
            for dtype in (torch.float32, torch.bfloat16):
                multirank._probe_once(op, dtype, torch.device("cpu"))
        assert dist.all_reduce(torch.ones(2), async_op=True).wait()
    finally:
        staging.uninstall()
    assert (dist.all_to_all_single, dist.batch_isend_irecv, allgather.all_gather_tensor) == real, "not restored"
    return list(multirank.PROBES)




def fsdp_step(family: str, lengths: tuple[int, ...]) -> dict:
    """One step of a tiny model under FSDP2 (``fully_shard`` over the CP group: the reduction a trainer applies over
    the ranks) and blockdiag's CP, the documents ``lengths`` packed into one row: the DSA model of ``family`` (its
    float64 build), or ``"deepseek_v4"`` (compressed attention; its float32 islands in float64 as in its truth).
    Returns :func:`~verify.model.harness.cp_step`'s step (FSDP leaves every rank the mean of the ranks' gradients;
    cp_step sums them over the ranks: the sum of their partial gradients), the parameters without a gradient on this
    rank, and whether the rank held padding only."""
    from contextlib import nullcontext

    from torch.distributed.fsdp import fully_shard

    from verify.model.harness import cp_step, text_forward

    mesh = worker_info()["cp_mesh"]
    if family == "deepseek_v4":
        from verify.model.compressed import _exactly, build_tiny_dsv4, dsv4_batch, dsv4_docs

        model = build_tiny_dsv4(torch.float64)
        batch, exact = dsv4_batch(dsv4_docs(lengths=lengths)), _exactly(model, True)
    else:
        from verify.model.sparse import build_tiny_dsa, dsa_batch, dsa_docs

        model = build_tiny_dsa(family, torch.float64)
        batch, exact = dsa_batch(dsa_docs(lengths=lengths)), nullcontext()
    fully_shard(model, mesh=mesh)
    with exact:
        step = cp_step(model, batch, mesh, text_forward, track_rows=True)
    return {"step": step, "without_gradient": sorted(n for n, p in model.named_parameters() if p.grad is None),
            "padding_only": bool(((step.rows < 0) | (step.rows >= sum(lengths))).all())}  # documents first, padding after


def exchange_under_nonreentrant_checkpoint(kind: str) -> list[float]:
    """An exchange (``allgather``, ``a2a`` or ``summary``) inside a non-reentrant checkpoint whose last rank uses what it
    received through ops that save nothing for backward (as a rank whose rows see no key may): every rank must
    still recompute the region, and so issue the recompute's forward collective, before the exchange's backward
    collective. Returns this rank's input gradient (the caller compares it with the analytic one)."""
    from torch.utils.checkpoint import checkpoint

    from blockdiag_dist.exchange.a2a import a2a_kv
    from blockdiag_dist.exchange.allgather import allgather_kv
    from blockdiag_dist.exchange.summary import exchange_summaries

    info = worker_info()
    group, world, rank = info["cp_mesh"].get_group(), info["world"], info["rank"]
    x = (torch.arange(6, dtype=torch.float64) + 10 * rank).view(3, 2).requires_grad_()

    def region(x: torch.Tensor) -> torch.Tensor:
        if kind == "allgather":
            got = allgather_kv(x, group, world)
        elif kind == "a2a":  # every rank sends its 3 rows to every rank
            got = a2a_kv(x, torch.arange(3).repeat(world), [3] * world, [3] * world, group)
        else:  # every rank sends its 6 values to every rank
            got = exchange_summaries(x.flatten().repeat(world), [6] * world, [6] * world, group)
        return got.sum() if rank == world - 1 else (got * got).sum()  # the last: nothing saved

    checkpoint(region, x, use_reentrant=False).backward()
    return x.grad.flatten().tolist()
