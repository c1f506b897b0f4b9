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
        triton_installed=importlib.util.find_spec("triton") is not None,
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
    return "pass"


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return None


def summarize(d: dict) -> list[str]:
    where = f"{d.get('gpus', 0)} x {d['gpu']} ({d['gpu_memory_bytes'] / 2**30:.0f} GiB, sm {d['capability'][0]}{d['capability'][1]})" if d.get("gpu") else f"{d.get('cpus')} CPUs, no GPU used"
    return [f"torch {d.get('torch')} (CUDA {d.get('torch_cuda')}), python {d.get('python')}; {where}; "
            f"flash-attn {'installed' if d.get('flash_attn_installed') else 'not installed'}"]
