"""axolotl-ringmaster's state passing for recurrent mixers (``ringmaster.strategies.state_passing``) on packed
documents, CP 2 on gloo: a small table of the conformance report (``python -m verify conformance --ringmaster-state``).

Rows:

- ``cp_linear_scan``: its exact CP linear scan ``h_t = a_t h_{t-1} + b_t`` (``[batch, L, d]`` per rank, contiguous
  shards), on one packed row of several documents, float64, judged against our float64 recurrence reference
  (``blockdiag_ref.reference_ssd`` with one-dimensional states: ``A = -1``, ``dt = -log a``, ``x = b / dt``,
  ``B = C = 1``: ``S_t = a_t S_{t-1} + b_t``, zero at each document's first token). Its docstring promises "a global
  scan of the full sequence" (no document argument): a failure against the per-document reference that passes
  against the whole-row reference is a **contract** (``document=row``), otherwise a **bug**.
- ``model step``: one training step of a tiny model from its config (Llama: attention only; Qwen3.5: Gated
  DeltaNet + attention; Nemotron-H: Mamba2 + attention) through ringmaster as its trainer adapters run one
  (:func:`_model_step_on_rank`), every parameter's gradient judged against each document run alone (float64,
  :func:`verify.trainers.per_document_truth`), or its refusal quoted.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["MODELS", "linear_scan_errors", "markdown", "run_state_rows"]

MODELS = ("llama", "qwen3_5", "nemotron_h")
ROWS = "1x5,2x4,3x6,0x1"  # one row: three documents (two straddle the rank boundary at 8), one padding token
LIMIT = 1e-10


def _doc_ids() -> torch.Tensor:
    from .cases import parse_rows

    (row,) = parse_rows(ROWS)
    return torch.tensor([[i for i, n in row for _ in range(n)]])


def _scan_inputs(S: int, d: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.rand(1, S, d, generator=g, dtype=torch.float64) * 0.5 + 0.45  # decays in (0.45, 0.95)
    b = torch.randn(1, S, d, generator=g, dtype=torch.float64)
    return a, b


def _reference(a: torch.Tensor, b: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """``h [1, S, d]`` per document (0 on padding), by ``reference_ssd`` with one-dimensional states."""
    from blockdiag_ref import reference_ssd

    _, S, d = a.shape
    dt = -torch.log(a)  # [1, S, d]: d heads
    ones = torch.ones(1, S, d, 1, dtype=torch.float64)
    return reference_ssd((b / dt)[..., None], dt, -torch.ones(d, dtype=torch.float64), ones, ones, doc_ids)[..., 0]


def _scan_on_rank() -> dict:
    import torch.distributed as dist

    from ringmaster.strategies.state_passing import cp_linear_scan

    ids = _doc_ids()
    a, b = _scan_inputs(ids.shape[1])
    world, rank = dist.get_world_size(), dist.get_rank()
    L = -(-ids.shape[1] // world)
    sl = slice(rank * L, (rank + 1) * L)
    return {"h": cp_linear_scan(a[:, sl], b[:, sl], dist.group.WORLD), "rows": (sl.start, min(sl.stop, ids.shape[1]))}


def linear_scan_errors(per_rank: list[dict]) -> dict[str, float]:
    """Largest relative error of the real tokens' states against the per-document and the whole-row references."""
    ids = _doc_ids()
    a, b = _scan_inputs(ids.shape[1])
    got = torch.cat([r["h"] for r in per_rank], dim=1)[:, :ids.shape[1]]
    real = ids[0] != 0
    out = {}
    for name, docs in (("documents", ids), ("row", torch.ones_like(ids))):
        ref = _reference(a, b, docs)
        out[name] = float((got - ref)[:, real].abs().max() / ref[:, real].abs().max())
    return out


def packed_row(n_docs: int = 6, seed: int = 3) -> dict[str, torch.Tensor]:
    """One packed row as a flattening collator gives it: ``input_ids``, ``labels`` (``-100`` at each document's
    first token), ``position_ids`` restarting at every document."""
    from examples.trl_sft import documents

    docs = documents(n_docs, seed=seed)
    ids = torch.tensor([sum(docs, [])])
    labels = ids.clone()
    starts = torch.tensor([0] + [len(d) for d in docs[:-1]]).cumsum(0)
    labels[0, starts] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": torch.cat([torch.arange(len(d)) for d in docs])[None]}


def _model_step_on_rank(model_type: str) -> dict:
    """One training step of a tiny ``model_type`` through ringmaster at the group's size, as its trainer adapters
    run one: ``setup`` (ring backend, SDPA blocks), the model on ``runtime.attn_implementation``,
    ``wire_recurrent_layers`` (its state passing), the ``ContextParallelContextManager`` pre-hook (shards the batch,
    global ``shift_labels``, the step's document boundaries, ``num_items_in_batch`` over the CP group), the loss's
    backward, then the gradients averaged over the ranks (what DDP / FSDP do). Rank 0 returns the gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import ringmaster as rm

    from examples.trl_sft import promoted

    from .model.hybrid import float64_kernel
    from .model.zoo import build, resolve

    world = dist.get_world_size()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("cp",))
    runtime = rm.setup(rm.RingmasterConfig(size=world, backend=rm.Backend.RING), device_mesh=mesh, device_type="cpu",
                       inner_attn="sdpa")
    try:
        model = build(resolve({"qwen3_5": "qwen3_5_text"}.get(model_type, model_type), tiny=True), torch.float64,
                      runtime.attn_implementation)
        wiring = rm.wire_recurrent_layers(model)
        batch = packed_row()
        targets = int((batch["labels"][:, 1:] != -100).sum())
        # the whole forward in float64, as the truth computes it (transformers casts norms, rotary angles, the loss
        # and the stock Mamba2 / Gated DeltaNet gates to float32 whatever the model's dtype)
        with float64_kernel(model), promoted(model):
            with rm.ContextParallelContextManager([model], runtime.cp_group):
                out = model(**batch, num_items_in_batch=targets, use_cache=False)
            out.loss.backward()
        wiring.restore()
        grads = {}
        for n, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.detach().clone()
                dist.all_reduce(g)
                grads[n] = g / world
        local = out.logits.shape[1]  # the rows this rank computed: the model ran on its shard only
        return {"grads": grads, "batch": batch, "local": local} if dist.get_rank() == 0 else {}
    finally:
        rm.teardown()


def run_state_rows(pool, *, timeout: float = 300.0, console=None) -> dict[str, Any]:
    """Every row on ``pool`` (2 gloo ranks), classed."""
    from .adapters.ringmaster import UNAVAILABLE, VERSION
    from .pool import PoolError
    from .trainers import TrainerRow, _failed, per_document_truth, worst_gradient_error

    out: dict[str, Any] = {"version": VERSION, "unavailable": UNAVAILABLE, "rows": [], "cp": pool.world}
    if UNAVAILABLE:
        return out
    t0 = time.perf_counter()
    row: dict[str, Any] = {"what": "cp_linear_scan", "on": f"one packed row {ROWS}, float64", "limit": LIMIT,
                           "replay": "python -m verify conformance --impls none --ringmaster-state"}
    try:
        errs = linear_scan_errors(pool.run(_scan_on_rank, timeout=timeout, name="ringmaster cp_linear_scan"))
    except PoolError as exc:
        shell = TrainerRow("cp_linear_scan", "-", cp=pool.world)
        _failed(shell, exc.failure)
        row.update(cls=shell.cls, message=shell.message, why=shell.why)
    else:
        row["errors"] = errs
        if errs["documents"] <= LIMIT:
            row["cls"] = "pass"
        elif errs["row"] <= LIMIT:
            row.update(cls="contract", why="differs only by document=row: the state crosses document boundaries "
                       f"(error {errs['documents']:.3g} against each document alone, {errs['row']:.2g} against one scan "
                       "of the whole row)")
        else:
            row.update(cls="bug", why=f"error {errs['documents']:.3g} per document, {errs['row']:.3g} over the row")
    out["rows"].append(row)
    for model in MODELS:
        row = {"what": "model step", "on": f"tiny {model} (from its config), one packed row of 6 documents, float64",
               "limit": LIMIT, "replay": "python -m verify conformance --impls none --ringmaster-state"}
        try:
            got = pool.run(_model_step_on_rank, args=(model,), timeout=timeout, name=f"ringmaster step {model}")[0]
        except PoolError as exc:
            shell = TrainerRow("model step", model, cp=pool.world)
            _failed(shell, exc.failure)
            row.update(cls=shell.cls, message=shell.message, why=shell.why)
        else:
            truth = per_document_truth(model, got["batch"])
            err, name = worst_gradient_error(got["grads"], truth)
            S = got["batch"]["input_ids"].shape[1]
            L = -(-S // pool.world)
            straddles = bool(got["batch"]["position_ids"][0, L] != 0)
            if got["local"] != L:
                raise RuntimeError(f"ringmaster step {model}: expected the model to run on {L} of {S} rows, got "
                                   f"{got['local']}: the batch was not sharded, the row would judge nothing")
            row["errors"] = {"documents": err}
            row["cls"] = "pass" if err <= LIMIT else "bug"
            row["why"] = (f"worst relative gradient error {err:.3g} (`{name}`) against each document alone; S = {S}, "
                          f"{L} rows per rank" + (", a document straddles the ranks" if straddles else ""))
        out["rows"].append(row)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if console:
        for r in out["rows"]:
            console.print(f"ringmaster state: {r['what']} {r['on']}: {r['cls']} {r.get('message', '')[:160]}",
                          markup=False)
    return out


def markdown(data: dict[str, Any]) -> list[str]:
    lines = ["## axolotl-ringmaster state passing (recurrent mixers)", ""]
    if data.get("unavailable"):
        return lines + [f"Skipped: {data['unavailable']}"]
    lines += [
        f"axolotl-ringmaster {data['version']}, CP {data['cp']} on gloo (CPU), `verify/ringmaster_state.py` "
        f"({data.get('seconds', 0)} s). `cp_linear_scan` is judged against our float64 recurrence reference "
        "(`blockdiag_ref.reference_ssd` with one-dimensional states, zero at each document's first token); the "
        "model step is one training step of a tiny model through ringmaster's setup, `wire_recurrent_layers` and "
        "its CP pre-hook (ring attention), gradients averaged over the ranks as DDP does, judged against each document "
        "run alone.",
        "",
        "| what | on | class | measured / refusal | replay |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in data["rows"]:
        said = (r.get("message") or r.get("why") or "-").replace("|", "\\|")
        lines.append(f"| `{r['what']}` | {r['on']} | {r['cls']} | {said} | `{r['replay']}` |")
    return lines
