"""The "Trainers" section of the conformance report (``python -m verify conformance --trainers``): packed training at
CP 2 through the trainers people use, each row one tiny model (from its config) trained one step on 2 gloo ranks,
its first-step gradients judged against each document run alone (float64), classed like the attention cases.

Paths (:data:`PATHS`):

- ``blockdiag-trainer``: ``BlockdiagTrainer`` (transformers' ``Trainer`` + blockdiag CP), ``DataCollatorWithFlattening``
  rows, the whole forward in float64 (:func:`examples.trl_sft.run_sft`, ``trainer="hf"``).
- ``blockdiag-sft``: ``BlockdiagSFTTrainer`` (TRL's ``SFTTrainer``, packing ``bfd``), float64 weights (TRL's fused LM
  head scores in float32: its limit is :data:`TRL_FLOAT32_HEAD_LIMIT`).
- ``accelerate-cp``: stock ``transformers.Trainer`` with ``TrainingArguments(parallelism_config=ParallelismConfig(
  cp_size=2))`` (accelerate's torch CP backend), SDPA attention, the same flattened rows.
- ``trl-packing-cp``: stock ``trl.SFTTrainer`` with ``SFTConfig(packing=True, parallelism_config=ParallelismConfig(
  cp_size=2))``.

The truth (:func:`per_document_truth`) and the error (:func:`worst_gradient_error`) are the ones the trainer tests use
(tests/trainer_checks.py imports them from here). A row is **pass** when the worst relative gradient error is within
its limit, **bug** when it is not (the number is given), **unsupported** when the path refuses on every rank with a
``ValueError`` / ``NotImplementedError`` (quoted), **crash** for any other exception, **hang** past the deadline.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

import torch

__all__ = ["FLOAT64_LIMIT", "PATHS", "TRL_FLOAT32_HEAD_LIMIT", "TrainerRow", "per_document_truth", "run_trainer_rows",
           "stock_step", "trainer_rows", "trainer_versions", "worst_gradient_error"]

FLOAT64_LIMIT = 1e-10
# TRL 1.16's SFTTrainer scores tokens with its fused LM head in float32 whatever the model's dtype
# (trl/kernels/chunked_logprob.py): measured 3.9e-7 (Llama) and 6.2e-7 (Qwen3.5) at CP 2 against the float64 truth.
TRL_FLOAT32_HEAD_LIMIT = 1e-6

PATHS = {
    "blockdiag-trainer": "BlockdiagTrainer (transformers Trainer + blockdiag CP), DataCollatorWithFlattening, float64",
    "blockdiag-sft": "BlockdiagSFTTrainer (TRL SFTTrainer + blockdiag CP), packing bfd, float64 weights",
    "accelerate-cp": "transformers Trainer, ParallelismConfig(cp_size=2) (accelerate's torch CP), SDPA, "
                     "DataCollatorWithFlattening, float64",
    "trl-packing-cp": "TRL SFTTrainer, packing bfd, ParallelismConfig(cp_size=2), SDPA, float64 weights",
}
LIMITS = {"blockdiag-trainer": FLOAT64_LIMIT, "blockdiag-sft": TRL_FLOAT32_HEAD_LIMIT, "accelerate-cp": FLOAT64_LIMIT,
          "trl-packing-cp": TRL_FLOAT32_HEAD_LIMIT}
DEFAULT_ROWS = (("blockdiag-trainer", "llama"), ("blockdiag-trainer", "qwen3_5"), ("blockdiag-sft", "llama"),
                ("blockdiag-sft", "qwen3_5"), ("accelerate-cp", "llama"), ("accelerate-cp", "qwen3_5"),
                ("trl-packing-cp", "llama"), ("trl-packing-cp", "qwen3_5"))
CP = 2


# ---- the truth and the error (shared with tests/trainer_checks.py) ------------------------------------------------
def per_document_truth(model_type: str, batch: dict, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the step's loss with each document of ``batch`` run alone through the same
    model (stock attention, one row, no CP), the losses summed over the step's targets.

    ``batch``: the collator's full rows (``input_ids``, ``labels`` in transformers' convention, ``position_ids``
    restarting at every document)."""
    from examples.trl_sft import promoted, tiny_model
    from verify.model.hybrid import float64_kernel

    model = tiny_model(model_type, dtype)
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    targets = int((labels[:, 1:] != -100).sum())
    # the stock Gated DeltaNet / Mamba2 compute gates in float32 (blockdiag's in float64); the rest as the runs do
    with float64_kernel(model), promoted(model):
        _documents_backward(model, ids, labels, pos, targets)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _documents_backward(model, ids, labels, pos, targets: int) -> None:
    for b in range(ids.shape[0]):
        starts = (pos[b] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for s, e in zip(starts[:-1], starts[1:]):
            lab = labels[b:b + 1, s:e]
            if e - s < 2 or bool((lab[:, 1:] == -100).all()):
                continue
            out = model(input_ids=ids[b:b + 1, s:e], labels=lab, num_items_in_batch=targets, use_cache=False)
            out.loss.backward()


def worst_gradient_error(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor],
                         skip: Callable[[str], bool] = lambda n: False) -> tuple[float, str]:
    """(largest relative error of a parameter's gradient, its name): ``max|g - t| / max|t|`` per parameter, every
    parameter of the truth but those ``skip`` names (a parameter without a gradient in ``got`` counts as all-zero)."""
    worst, name = 0.0, ""
    for n, t in truth.items():
        if skip(n):
            continue
        g = got.get(n, torch.zeros_like(t))
        err = float((g.double() - t.double()).abs().max() / t.double().abs().max().clamp_min(1e-300))
        if err > worst:
            worst, name = err, n
    return worst, name


# ---- the stock paths ----------------------------------------------------------------------------------------------
def stock_step(path: str, model_type: str, cp: int = CP, rows: int = 4, max_length: int = 64) -> dict:
    """One step of a stock trainer with accelerate's CP (``ParallelismConfig(cp_size=cp)``) on this rank of the
    default group: ``accelerate-cp`` (transformers' ``Trainer``, ``DataCollatorWithFlattening``) or ``trl-packing-cp``
    (TRL's ``SFTTrainer``, packing ``bfd``). The model is the tiny ``model_type`` on SDPA (what accelerate's CP
    accepts), float64. Returns the first step's full batch (before CP) and every parameter's gradient."""
    from accelerate.parallelism_config import ParallelismConfig
    from datasets import Dataset
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from blockdiag_dist.integrations.trainer import environment_from_group
    from examples.trl_sft import documents, promoted, tiny_tokenizer
    from verify.model.zoo import build, resolve

    environment_from_group()
    common = dict(output_dir=tempfile.mkdtemp(prefix="verify-trainers-"), max_steps=1, per_device_train_batch_size=rows,
                  learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
                  data_seed=0, dataloader_drop_last=True, disable_tqdm=True, max_grad_norm=0.0, save_strategy="no",
                  bf16=False, fp16=False, parallelism_config=ParallelismConfig(cp_size=cp))
    model = build(resolve({"qwen3_5": "qwen3_5_text"}.get(model_type, model_type), tiny=True), torch.float64, "sdpa")
    data = Dataset.from_dict({"input_ids": documents(200)})
    if path == "trl-packing-cp":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(packing=True, packing_strategy="bfd", max_length=max_length, **common)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tiny_tokenizer())
    elif path == "accelerate-cp":
        args = TrainingArguments(remove_unused_columns=False, **common)
        trainer = Trainer(model=model, args=args, train_dataset=data,
                          data_collator=DataCollatorWithFlattening(return_tensors="pt"))
    else:
        raise ValueError(f"stock_step: expected path 'accelerate-cp' or 'trl-packing-cp', got {path!r}")
    recorded: dict = {}

    class FirstStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            recorded.setdefault("grads", {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                          if p.grad is not None})

    trainer.add_callback(FirstStep())
    prepare = trainer._prepare_context_parallel_inputs

    def keep_batch(model, inputs):  # the full rows, before accelerate's CP shards them in place
        recorded.setdefault("batch", {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return prepare(model, inputs)

    trainer._prepare_context_parallel_inputs = keep_batch
    with promoted(trainer.model, path == "accelerate-cp"):
        trainer.train()
    return recorded


def _row_on_rank(path: str, model_type: str, cp: int) -> dict:
    """Pool worker: one step of ``path``; rank 0 returns the batch and the gradients, the others nothing."""
    torch.set_num_threads(1)
    if path.startswith("blockdiag-"):
        from examples.trl_sft import run_sft

        trainer = "hf" if path == "blockdiag-trainer" else "sft"
        out = run_sft(model_type, cp, 1, "float64", record_first_step=True, trainer=trainer, float64=trainer == "hf")
    else:
        out = stock_step(path, model_type, cp)
    if torch.distributed.get_rank() != 0:
        return {}
    return {"batch": out["batch"], "grads": out["grads"]}


# ---- rows -----------------------------------------------------------------------------------------------------------
@dataclass
class TrainerRow:
    path: str
    model: str
    cp: int = CP
    cls: str = ""
    error: float | None = None  # worst relative gradient error against the per-document truth
    worst_param: str = ""
    limit: float = 0.0
    message: str = ""  # the refusal or the exception, quoted
    why: str = ""
    seconds: float = 0.0
    replay: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trainer_versions() -> dict[str, str]:
    """The installed versions the rows depend on."""
    out = {}
    for package in ("torch", "transformers", "accelerate", "trl"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def replay_command(path: str, model: str) -> str:
    return f"python -m verify conformance --impls none --trainers --trainer-rows {path}:{model}"


def _failed(row: TrainerRow, failure) -> None:
    from .classify import REFUSALS, _last_exception, _rank_tracebacks

    details = str(failure)
    if failure.kind == "timeout":
        row.cls, row.why = "hang", f"deadline passed on rank(s) {failure.ranks}"
        return
    if failure.kind == "crash":
        row.cls, row.why = "crash", f"rank(s) {failure.ranks} died"
        return
    excs = [_last_exception(tb) for tb in _rank_tracebacks(details)]
    every_rank = sorted(failure.ranks) == list(range(row.cp))
    t, msg = excs[0] if excs else ("", "")
    row.message = f"{t}: {msg}" if t else details.splitlines()[0]
    if excs and every_rank and all(e in REFUSALS and m for e, m in excs):
        row.cls, row.why = "unsupported", f"{t} on every rank"
    else:
        row.cls, row.why = "crash", f"raised on rank(s) {failure.ranks}" + ("" if every_rank else " only")


def trl_guard() -> dict[str, str] | None:
    """TRL's own refusal of packing under context parallelism, read from the installed ``trl``'s source (the
    ``raise ValueError`` in ``SFTTrainer.__init__`` that names both): ``{"text": ..., "where": "file:line"}``, or None
    when trl is missing or has no such guard. It runs after accelerate builds its ``Accelerator``, so on CPU
    accelerate's own refusal (``MULTI_CPU``) comes first."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("trl")  # read, not imported (importing trl takes seconds)
    path = os.path.join(spec.submodule_search_locations[0], "trainer", "sft_trainer.py") if spec else ""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            arg = node.exc.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "context parallelism" in arg.value \
                    and "Packing" in arg.value:
                name = getattr(node.exc.func, "id", "?")
                where = f"trl/trainer/{os.path.basename(path)}:{node.lineno}"
                return {"text": f"{name}: {arg.value}", "where": where}
    return None


def trainer_rows(spec: str | None = None) -> list[tuple[str, str]]:
    """``"path:model,path:model"`` -> pairs (default: :data:`DEFAULT_ROWS`); unknown paths are refused."""
    if not spec:
        return list(DEFAULT_ROWS)
    pairs = []
    for item in spec.split(","):
        path, _, model = item.strip().partition(":")
        if path not in PATHS or not model:
            raise ValueError(f"--trainer-rows: expected PATH:MODEL with PATH one of {sorted(PATHS)}, got {item!r}")
        pairs.append((path, model))
    return pairs


def run_trainer_rows(rows: Sequence[tuple[str, str]] = DEFAULT_ROWS, *, timeout: float = 300.0, console=None,
                     pool=None) -> dict[str, Any]:
    """Run and class every ``(path, model)`` row on a 2-rank gloo pool (``pool``, or one started here)."""
    from .pool import PoolError, WorkerPool

    versions = trainer_versions()
    out: dict[str, Any] = {"versions": versions, "cp": CP, "rows": [], "trl_guard": trl_guard()}
    own = pool is None
    pool = pool or WorkerPool(CP, collective_timeout=timeout, keep_after_uniform_error=True)
    t_all = time.perf_counter()
    try:
        for path, model in rows:
            row = TrainerRow(path, model, limit=LIMITS[path], replay=replay_command(path, model), versions=versions)
            t0 = time.perf_counter()
            try:
                got = pool.run(_row_on_rank, args=(path, model, CP), timeout=timeout, name=f"{path} {model} at CP {CP}")
            except PoolError as exc:
                _failed(row, exc.failure)
            else:
                truth = per_document_truth(model, got[0]["batch"])
                row.error, row.worst_param = worst_gradient_error(got[0]["grads"], truth)
                missing = sorted(set(truth) - set(got[0]["grads"]))
                if row.error <= row.limit and not missing:
                    row.cls = "pass"
                else:
                    row.cls = "bug"
                    row.why = (f"gradient of {row.worst_param} off by {row.error:.3g} relative (limit {row.limit:g})"
                               + (f"; {len(missing)} parameters without a gradient" if missing else ""))
            row.seconds = round(time.perf_counter() - t0, 1)
            out["rows"].append(row.to_dict())
            if console:
                num = f", error {row.error:.3g}" if row.error is not None else ""
                console.print(f"trainers: {path} {model}: {row.cls}{num} ({row.seconds} s) {row.message[:160]}",
                              markup=False)
    finally:
        if own:
            pool.close()
    out["seconds"] = round(time.perf_counter() - t_all, 1)
    return out


def markdown(data: dict[str, Any]) -> list[str]:
    """The report's "Trainers" section."""
    v = data["versions"]
    lines = [
        "## Trainers", "",
        f"Packed training at CP {data['cp']} on 2 gloo ranks (CPU) through the trainers people use: one step of a tiny "
        "model from its config, every parameter's gradient compared with each document run alone on one device "
        "(float64, `verify/trainers.py`). Versions: " + ", ".join(f"{k} {val}" for k, val in v.items())
        + f"; {data['seconds']} s in all. Classes as above: **pass** (worst relative gradient error within the limit), "
        "**bug** (above it: the number is measured), **unsupported** (refused on every rank, quoted), **crash**, **hang**.",
        "",
        "| path | model | class | worst gradient error (limit) | refusal / exception | replay |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["rows"]:
        err = f"{r['error']:.2e} ({r['limit']:g}) in `{r['worst_param']}`" if r["error"] is not None else "-"
        msg = r["message"].replace("|", "\\|")
        cls = "**BUG**" if r["cls"] == "bug" else r["cls"]
        lines.append(f"| {r['path']} | {r['model']} | {cls} | {err} | {msg or '-'} | `{r['replay']}` |")
    lines += ["", "Paths:", ""] + [f"- `{p}`: {d}" for p, d in PATHS.items()]
    guard = data.get("trl_guard")
    if guard and any(r["path"] == "trl-packing-cp" for r in data["rows"]):
        lines += ["", f"TRL's own guard, read (not run) from the installed trl's source (`{guard['where']}`): it is "
                  "checked after the `Trainer` has built its `Accelerator`, so on CPU accelerate's refusal above comes "
                  f"first; where accelerate's CP builds (CUDA), this is the refusal: \"{guard['text']}\""]
    return lines
