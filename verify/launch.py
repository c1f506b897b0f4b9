"""Running under torchrun: use the launched process group instead of spawning pools."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["torchrun_env", "under_torchrun"]

_env: dict = {}


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def torchrun_env(backend: str | None = None):
    """(cp_mesh, rank, world, device) of the launched group, initialised on first use."""
    if not _env:
        from torch.distributed.device_mesh import init_device_mesh

        use_cuda = (backend or os.environ.get("BLOCKDIAG_BACKEND", "")) == "nccl" or (
            backend is None and torch.cuda.is_available()
        )
        if use_cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if not dist.is_initialized():
            dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"))
        device_type = "cuda" if use_cuda else "cpu"
        world = dist.get_world_size()
        _env.update(
            mesh=init_device_mesh(device_type, (world,)), rank=dist.get_rank(), world=world,
            device=torch.device(device_type, int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu"),
        )
    return _env["mesh"], _env["rank"], _env["world"], _env["device"]
