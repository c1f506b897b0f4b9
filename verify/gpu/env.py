"""Step ``env``: the machine the other steps ran on (torch, CUDA, the GPU, which SDPA backends are enabled)."""

from __future__ import annotations

import importlib.util
import os
import platform

import torch
import torch.distributed as dist
from torch import Tensor

from .step import StepContext

__all__ = ["run", "summarize", "topk_ties"]


def run(ctx: StepContext) -> str:
    d = ctx.data
    d.update(
        python=platform.python_version(), torch=torch.__version__, numpy=_version("numpy"), cpus=os.cpu_count(),
        cuda_available=torch.cuda.is_available(), torch_cuda=torch.version.cuda,
        gloo=dist.is_gloo_available(), nccl=dist.is_nccl_available(),
        flash_attn_installed=importlib.util.find_spec("flash_attn") is not None,
        fla_installed=importlib.util.find_spec("fla") is not None,
        triton_installed=importlib.util.find_spec("triton") is not None,
        versions={m: _version(m) for m in ("flash_attn", "fla", "triton")},
        sdpa_enabled={
            "flash": torch.backends.cuda.flash_sdp_enabled(), "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled(),
        },
    )
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        d.update(
            gpus=torch.cuda.device_count(), gpu=props.name, capability=list(torch.cuda.get_device_capability(0)),
            gpu_memory_bytes=props.total_memory, cudnn=torch.backends.cudnn.version(),
            nccl_version=_nccl_version(),
        )
        torch.ones(1, device="cuda").add_(1).item()  # a context and one kernel: the device works
    d["flash_path"] = _flash_path(ctx.device)
    d["topk_ties"] = topk_ties(ctx.device, quick=ctx.quick)
    if d["topk_ties"]["rows_differing"]:
        d["error"] = ("topk: expected the same choice among equal scores for a row whatever the call's other rows (DSA's "
                      f"selection under CP relies on it), got {d['topk_ties']['rows_differing']} rows differing")
        return "fail"
    return "pass"


def topk_ties(device: str, quick: bool = False) -> dict:
    """Which of equal scores ``torch.topk`` keeps on ``device``, for rows of small integers (ties everywhere) with
    later keys at ``-inf``, as DSA's indexer calls it: the same for a document's whole ``[n, n]`` call, a chunk of
    its rows and one row (what :mod:`blockdiag_dist.sparse` relies on: a rank calls it on its chunk, the model alone
    on the whole document)? As DSA reads the choice: a later key taken (a row with fewer than ``k`` earlier keys)
    counts as ``-1`` whichever it is. ``rows_differing`` counts the rows where it was not; ``rows_differing_from_cpu``
    (on CUDA) the rows of the chunks where the CPU kept others."""

    def chosen(scores: Tensor, first: int, k: int) -> Tensor:  # sorted; later keys as -1, as sparse._select reads them
        idx = scores.topk(k, dim=-1).indices
        row = first + torch.arange(scores.shape[0], device=idx.device)[:, None]
        return torch.where(idx <= row, idx, -1).sort(-1).values

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    sizes = ((8, 4, 4, 20), (64, 7, 16, 5)) if quick else ((8, 4, 4, 200), (300, 37, 64, 20), (4096, 129, 2048, 4))
    out = {"rows_compared": 0, "rows_differing": 0, "sizes": [[n, k] for n, _, k, _ in sizes]}
    if dev.type != "cpu":
        out.update(rows_vs_cpu=0, rows_differing_from_cpu=0)
    for n, c, k, trials in sizes:
        for _ in range(trials):
            x = torch.randint(-2, 3, (n, n), generator=g, device=dev).float()
            x = x.masked_fill(torch.ones(n, n, dtype=torch.bool, device=dev).triu(1), float("-inf"))
            whole = chosen(x, 0, k)
            for start in (0, n // 2, n - c):
                for rows in (c, 1):
                    part = chosen(x[start:start + rows].clone(), start, k)
                    out["rows_differing"] += int((whole[start:start + rows] != part).any(-1).sum())
                    out["rows_compared"] += rows
            if dev.type != "cpu":
                cpu = chosen(x[n - c:].cpu(), n - c, k)
                out["rows_differing_from_cpu"] += int((whole[n - c:].cpu() != cpu).any(-1).sum())
                out["rows_vs_cpu"] += c
    return out


def _flash_path(device: str) -> dict[str, str]:
    """Whether blockdiag's varlen kernel calls flash-attn here, per head dim (bfloat16): "used" or the
    fallback's reason, and which functions it would call (on CPU: the emulations the dry run installs)."""
    from blockdiag_dist.kernels.varlen import flash_unusable_reason

    from . import emulate

    how = emulate.for_device(device)
    q = torch.zeros(1, 1, 1, dtype=torch.bfloat16, device=device)
    return {"functions": how, **{f"D={dim}": flash_unusable_reason(q, dim, dim, sequences=1) or "used" for dim in (64, 128, 256, 264)}}


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return str(getattr(importlib.import_module(module), "__version__", "unknown version"))
    except Exception as exc:  # noqa: BLE001 - an installed package that fails to import is worth knowing about
        return f"installed, import fails: {type(exc).__name__}: {exc}"[:300]


def summarize(d: dict) -> list[str]:
    where = f"{d.get('gpus', 0)} x {d['gpu']} ({d['gpu_memory_bytes'] / 2**30:.0f} GiB, sm {d['capability'][0]}{d['capability'][1]})" if d.get("gpu") else f"{d.get('cpus')} CPUs, no GPU used"
    return [f"torch {d.get('torch')} (CUDA {d.get('torch_cuda')}), python {d.get('python')}; {where}; "
            f"flash-attn {d.get('versions', {}).get('flash_attn') or 'not installed'}, fla {d.get('versions', {}).get('fla') or 'not installed'}, "
            f"triton {d.get('versions', {}).get('triton') or 'not installed'}; flash path by head dim: {d.get('flash_path')}"] + (
        [_ties_line(d["topk_ties"])] if "topk_ties" in d else []) + ([f"FAILED {d['error']}"] if d.get("error") else [])


def _ties_line(t: dict) -> str:
    line = (f"topk among equal scores: {t['rows_differing']} of {t['rows_compared']} rows chose differently in a chunk's "
            f"or one row's call than in the whole [n, n] call (n, k: {t['sizes']})")
    if "rows_vs_cpu" in t:
        line += f"; the CPU chose differently in {t['rows_differing_from_cpu']} of {t['rows_vs_cpu']} rows"
    return line
