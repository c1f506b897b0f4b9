"""axolotl-ringmaster's ring attention (``axolotl-ringmaster==0.2.7``, ``make peers``) behind the seed's API; its
Ulysses attention is :mod:`verify.adapters.ringmaster_ulysses` (the same adapter, the other backend).

What a trainer does with ringmaster, done on the verifier's batch: ``ringmaster.setup(RingmasterConfig(size=CP,
backend=...), device_mesh=<the CP group as a mesh dim "cp">, device_type, inner_attn="sdpa")`` installs the runtime
and registers the attention function under ``runtime.attn_implementation``; ringmaster's own
collator-side sharding (``shard.shard_collated_batch``, for CP ranks that hold the same batch, as here) prepares
the global batch (``prepare_global_batch``: a 2-D mask of segment numbers becomes restarting ``position_ids``; any
other mask is refused) and shards it (contiguous, its default ``load_balance="none"``); its
``ContextParallelContextManager`` pre-hook, installed on a carrier module whose forward takes the batch, consumes
the shard description and stores the step's document boundaries (``runtime.varlen``). (The pre-hook's other path,
``broadcast_batch`` from the group's first rank, replaces the other ranks' tensors by received copies without an
autograd graph: fine for ``input_ids``, not for the verifier's differentiable ``inputs_embeds``.) The attention
call is the registered function, ``fn(module, q, k, v, None, scaling=..., is_causal=True)`` on ``[B, H, L, D]``
(it returns ``[B, L, H, D]``).

Documents reach ringmaster as its trainer path gets them: restarting ``position_ids`` (what a flattening collator
such as transformers' ``DataCollatorWithFlattening`` gives). For the ``packed`` source the adapter turns the
case's ids into those positions (restart at the start of every run of one id, padding runs included: a padding
run is a segment of its own), since ringmaster reads no ``_packed_seq_ids``; the ``mask2d`` source goes to
ringmaster as is (its own segment-number derivation); ``mask4d`` goes as is (ringmaster refuses it).

Conventions, from its code (``shard.py``, ``strategies/ring.py``, ``strategies/ulysses.py``, ``ring/loop.py``):
document = a run between two restarts of ``position_ids`` (our "run"); padding tokens are ordinary tokens of
their own segment (not zeroed); a 4-D ``attention_mask`` is refused (``ValueError``); a 2-D mask must be
right-padded (middle or left padding refused); B > 1 native (boundaries per row); CP 1 is no ringmaster at all
(``RingmasterConfig(size=1).enabled`` is False: ``setup`` installs nothing and returns the inner kernel's name,
so the adapter refuses CP 1 rather than judge the model's own attention); Ulysses needs the head counts divisible
by the CP size (refused with ``ValueError`` otherwise); no windows offered (``sliding_window`` is the model
module's attribute, not an SDPA argument). On CPU the ring's packed path is ``varlen_ring_attention``'s
dense-mask SDPA fallback (its flash path needs CUDA); a row that is one document (no restart) takes the
unpacked ring, ``aten._scaled_dot_product_flash_attention`` blocks.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from .conventions import Conventions, Unsupported
from .peer import import_peer, start_batch

__all__ = ["CONVENTIONS", "UNAVAILABLE", "VERSION", "RingmasterAdapter", "cp_blockdiag_sdpa",
           "make_cp_blockdiag_batch_and_ctx", "restarting_positions"]


def _load():
    import ringmaster
    from ringmaster import shard

    return ringmaster, shard


_loaded, VERSION, UNAVAILABLE = import_peer(_load, "axolotl-ringmaster")
_rm, _rm_shard = _loaded or (None, None)

_COMMON = dict(
    document="run",
    padding="free",
    mask4d="documents",  # never read: ringmaster refuses a 4-D mask (ValueError, quoted by the report)
    batch_rows="any (document boundaries per row)",
    cp1="none: RingmasterConfig(size=1).enabled is False (setup installs no attention); the adapter refuses CP 1",
    layouts="contiguous shards (load_balance='none', its default), S padded to a multiple of CP",
    windows="none",
    sources=("packed", "mask4d", "mask2d"),
)

CONVENTIONS = Conventions(
    **_COMMON,
    notes=(
        "packed doc ids reach ringmaster as restarting position_ids (a flattening collator's form; padding runs are "
        "segments of their own); a 2-D mask of ids goes as is (ringmaster derives the positions; it refuses middle "
        "or left padding); a 4-D mask goes as is (refused).",
        "CPU: the ring's packed path is varlen_ring_attention's dense-mask SDPA over all-gathered K/V; a row of one "
        "document takes the unpacked ring's aten._scaled_dot_product_flash_attention blocks.",
    ),
)
ULYSSES_CONVENTIONS = Conventions(
    **_COMMON,
    notes=(
        "packed doc ids reach ringmaster as restarting position_ids (as for the ring backend); Ulysses needs "
        "Hq and Hkv divisible by the CP size (ValueError otherwise).",
        "CPU/gloo: the all-to-all is ringmaster's all_gather emulation; the packed path is _ulysses_varlen's "
        "dense document mask through SDPA (inner_attn='sdpa').",
    ),
)


def restarting_positions(doc_ids_BS: Tensor) -> Tensor:
    """``[B, S]`` position_ids restarting at 0 at the start of every run of one id (padding runs included), as a
    flattening collator writes them: ``[[1, 1, 2, 0, 0]]`` -> ``[[0, 1, 0, 0, 1]]``."""
    S = doc_ids_BS.shape[1]
    pos = torch.arange(S, device=doc_ids_BS.device).expand_as(doc_ids_BS)
    start = torch.ones_like(doc_ids_BS, dtype=torch.bool)
    start[:, 1:] = doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
    return pos - torch.where(start, pos, 0).cummax(dim=1).values


class _Carrier(nn.Module):
    """The module ringmaster's pre-hook is installed on: its forward returns the (sharded) batch it receives."""

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None, attention_mask=None, labels=None,
                **rest):
        return {"input_ids": input_ids, "inputs_embeds": inputs_embeds, "position_ids": position_ids,
                "labels": labels, **rest}


class _Attention(nn.Module):
    """What the registered attention function reads of a model's attention module (no config, no window)."""

    is_causal = True

    def __init__(self) -> None:
        super().__init__()
        self.num_key_value_groups = 1


class RingmasterAdapter:
    """The seed's two functions through ringmaster with ``backend`` ("ring" or "ulysses")."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.attn_name: str | None = None
        self.active = False
        self.module = _Attention()

    def _setup(self, cp_mesh) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(cp_mesh.get_group(), cp_mesh.device_type, mesh_dim_names=("cp",))
        config = _rm.RingmasterConfig(size=cp_mesh.size(), backend=_rm.Backend(self.backend))
        runtime = _rm.setup(config, device_mesh=mesh, cp_dim="cp", device_type=cp_mesh.device_type, inner_attn="sdpa")
        self.attn_name = runtime.attn_implementation
        return runtime

    def make_cp_blockdiag_batch_and_ctx(self, cp_mesh, tp_mesh, batch: dict[str, Any], loss_mask: Tensor | None = None,
                                        padding_token_id: int = 0):
        """ringmaster's setup and its CP pre-hook on this batch; ``batch["position_ids"]`` then holds the global
        positions of this rank's rows and ``batch["padding_mask"]`` the padding rows (the verifier's bookkeeping)."""
        if _rm is None:
            raise ImportError(UNAVAILABLE)
        world, rank = cp_mesh.size(), cp_mesh.get_local_rank()
        if world == 1:
            raise Unsupported(
                f"ringmaster {VERSION} does not run at CP 1: RingmasterConfig(size=1).enabled is False, so setup() "
                "installs no attention and returns the inner kernel's name (the model's own attention runs)")
        mask = batch.get("attention_mask")
        primary, B, S, ids = start_batch(batch, loss_mask)  # drops attention_mask; ids: the case's documents
        runtime = self._setup(cp_mesh)
        given = {"inputs_embeds": primary, "input_ids": torch.zeros(B, S, dtype=torch.long, device=primary.device)}
        if batch.get("labels") is not None:
            given["labels"] = batch["labels"]
        if mask is not None:  # a mask source, without position_ids: ringmaster derives them (or refuses the mask)
            given["attention_mask"] = mask
        else:  # _packed_seq_ids: the flattening collator's restarting positions
            given["position_ids"] = restarting_positions(ids)
        # every rank of the CP group holds the same batch: ringmaster's collator-side sharding (no broadcast), whose
        # shard description its pre-hook consumes (document boundaries into runtime.varlen)
        given = _rm_shard.shard_collated_batch(given, cp_rank=rank, cp_size=world,
                                               load_balance=runtime.shard_load_balance)
        carrier = _Carrier()
        with _rm.ContextParallelContextManager([carrier], runtime.cp_group,
                                               load_balance=runtime.shard_load_balance):
            got = carrier(**given)
        L = got["inputs_embeds"].shape[1]
        pad = L * world - S
        full_ids = torch.cat([ids, ids.new_zeros(B, pad)], dim=1) if pad else ids
        out = {k: v for k, v in batch.items() if not isinstance(v, Tensor) or v.dim() < 2}
        out.update(inputs_embeds=got["inputs_embeds"], labels=got["labels"],
                   position_ids=torch.arange(rank * L, (rank + 1) * L, device=primary.device).expand(B, L),
                   padding_mask=full_ids[:, rank * L:(rank + 1) * L] == 0)
        if loss_mask is not None:
            lm = torch.cat([loss_mask, loss_mask.new_zeros(B, pad)], dim=1) if pad else loss_mask
            out["loss_mask"] = lm[:, rank * L:(rank + 1) * L]

        @contextlib.contextmanager
        def train_ctx():
            self.active = True
            try:
                yield
            finally:
                self.active = False

        return train_ctx, out

    def cp_blockdiag_sdpa(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                          enable_gqa: bool = False) -> Tensor:
        """``[B, H, L, D]`` in and out: the registered ringmaster attention, causal, inside ``train_ctx``."""
        if _rm is None:
            raise ImportError(UNAVAILABLE)
        if not self.active:
            return torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.module.num_key_value_groups = query.shape[1] // key.shape[1]
        out, _ = ALL_ATTENTION_FUNCTIONS[self.attn_name](self.module, query, key, value, None, dropout=dropout_p,
                                                          scaling=scale, is_causal=True)
        return out.transpose(1, 2)


_ring = RingmasterAdapter("ring")
make_cp_blockdiag_batch_and_ctx = _ring.make_cp_blockdiag_batch_and_ctx
cp_blockdiag_sdpa = _ring.cp_blockdiag_sdpa
