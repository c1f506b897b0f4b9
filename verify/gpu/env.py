"""Step ``env``: the machine the other steps ran on (torch, CUDA, the GPU, which SDPA backends are enabled)."""

from __future__ import annotations

import importlib.util
import os
import platform

import torch
import torch.distributed as dist

from .step import StepContext

__all__ = ["run", "summarize"]


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
    return "pass"


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
            f"triton {d.get('versions', {}).get('triton') or 'not installed'}; flash path by head dim: {d.get('flash_path')}"]
