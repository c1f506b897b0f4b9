"""``--layer sparse``: DeepSeek Sparse Attention. ``q = x Wq [B, S, H, D]`` (``H = case.hq``, ``D = case.dim``), a
latent ``c = x Wl [B, S, D + 2]`` expanded to keys ``c Wk`` and values ``c Wv [., H, D + 1]``; an indexer of
``case.hkv`` heads of ``D`` whose queries, keys and weights are small integers drawn per position
(:func:`index_inputs`: the indexer has no gradient, and its scores are then exact in every dtype: the same top-k,
ties included, in the reference and the implementation) keeping the top ``case.width`` keys of each query's
document prefix -> attention over them -> ``Wo`` -> summed cross-entropy.

The latents and indexer keys of earlier ranks travel in the attention's exchange (``state.traffic``, not the
mixers'): the spec checks that each forward received exactly the needed tokens' ``D + 2 + D`` elements (halo or
all-to-all; an all-gather is not needed-only). Planted bugs: the indexer's top-k over the row's earlier tokens, not
the query's document (``topk_over_row``); the expanded keys and values out of the graph on a rank whose rows use
none of them, so that the expansion's weights get no gradient there (``expand_unused``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._spec import VOCAB, MixerSpec

__all__ = ["INDEX_SCALE", "SPEC", "index_inputs"]

INDEX_SCALE = 0.5  # the indexer's scale: a power of two keeps its integer scores exact


def index_inputs(case) -> dict[str, Tensor]:
    """The indexer's inputs of a ``sparse`` case, ``[B, S, ...]`` float64 small integers (exact in every dtype):
    ``iq [B, S, Hi, D]``, ``ik [B, S, D]``, ``iw [B, S, Hi]`` (``Hi = case.hkv``, ``D = case.dim``). Identical on
    every rank (one seeded generator)."""
    g = torch.Generator().manual_seed(3000 + case.seed)
    B, S, Hi, D = case.batch_size, case.seq_len, case.hkv, case.dim
    draw = lambda *shape: torch.randint(-2, 3, shape, generator=g).to(torch.float64)  # noqa: E731
    return {"iq": draw(B, S, Hi, D), "ik": draw(B, S, D), "iw": draw(B, S, Hi)}


def _weights(case, w, n):
    return {"wq": w(n["E"], n["H"] * n["D"]), "wl": w(n["E"], n["F"]), "wk": w(n["F"], n["H"] * n["D"]),
            "wv": w(n["F"], n["H"] * n["Dv"]), "wo": w(n["H"] * n["Dv"], VOCAB)}


def _block(case, x, ws, mix, n):
    B, L, _ = x.shape
    res = {"q": (x @ ws["wq"]).view(B, L, n["H"], n["D"]), "latent": x @ ws["wl"]}
    for t in res.values():
        t.retain_grad()

    def expand(rows: Tensor) -> tuple[Tensor, Tensor]:  # [T, F] -> keys [T, H, D], values [T, H, Dv]
        return (rows @ ws["wk"]).view(-1, n["H"], n["D"]), (rows @ ws["wv"]).view(-1, n["H"], n["Dv"])

    out = mix(res["q"].transpose(1, 2), res["latent"], expand).transpose(1, 2)  # [B, L, H, Dv]
    return res, out, out.reshape(B, L, -1)


def _reference_mix(reference, ids, dtype, *, case, **_):
    idx = index_inputs(case)

    def mix(q, latent, expand):
        B, S = latent.shape[:2]
        k, v = expand(latent.reshape(B * S, -1))
        k, v = (t.view(B, S, *t.shape[1:]).transpose(1, 2) for t in (k, v))
        # scores in float32 as the model computes them (exact here: small integers), topk on the same rows and on
        # the implementation's device: which of equal scores topk keeps differs between devices (CPU and CUDA)
        iq, iw, ik = (idx[name].to(q.device) for name in ("iq", "iw", "ik"))
        return reference(q, k, v, iq, iw, ik, ids, case.width, index_scale=INDEX_SCALE, score_dtype=torch.float32)[0]

    return mix


def _impl_mix(fn, *, case, batch, device, dtype, **_):
    from blockdiag_dist.sparse import DsaIndex

    idx = index_inputs(case)
    pos = batch["position_ids"].to(torch.int64).clamp(max=case.seq_len - 1).cpu()  # CP padding: any row
    rows = torch.arange(case.batch_size)[:, None].expand_as(pos)
    index = DsaIndex(query=idx["iq"][rows, pos].to(device, dtype), key=idx["ik"][rows, pos].to(device, dtype),
                     weights=idx["iw"][rows, pos].to(device, torch.float32), scale=INDEX_SCALE)

    def mix(q, latent, expand):
        return fn(q, latent, expand, topk=case.width, index=index)[0]

    return mix


def _received(case, state, rank, n):
    return None  # its keys travel in the attention's exchange (state.traffic), not the mixers': _check_exchange


def _check_exchange(case, state, rank, m, calls, n) -> str:
    """The keys' exchange: the attention's, for an unbounded window, needed-only (latents and indexer keys of each
    needed token, once per forward)."""
    mode = state.window_plan(-1).mode
    needed = state.comm_report(-1)["min_recv"][rank] if mode != "allgather" else None
    got = state.traffic.totals("forward")["recv_elements"]
    if needed is not None:
        m.equal("dsa_recv_elements_fwd", got, calls * needed * (n["F"] + n["D"]))
    return mode


def _topk_over_row():
    from blockdiag_dist.mixers._common import active_state
    from blockdiag_dist.sparse import _dsa, _Piece

    def row_pieces(state, wp):
        """Each piece's candidates: every earlier token of its row in the key buffer, whatever its document."""
        sp, out = state.plan.shards.padded_len, []
        for p in state.docs.pieces:
            flat = p.row * sp + torch.arange(0, p.end)
            rows = wp.key_index[flat]
            keep = rows >= 0
            rows, before = rows[keep], int(keep[: p.start].sum())
            out.append(_Piece(p.row, p.local_start, p.length, before, before + p.length, rows.to(state.device)))
        return tuple(out)

    def dsa_attention(query: Tensor, latent: Tensor, expand, *, topk: int, index=None, selection=None, scale=None,
                      dropout_p: float = 0.0, state=None):
        state = active_state(state, query, "dsa_attention")
        return _dsa(query, latent, expand, topk, index, selection, scale, dropout_p, state, row_pieces)

    return dsa_attention


def _expand_unused():
    from blockdiag_dist.mixers._common import active_state
    from blockdiag_dist.sparse import _dsa, _pieces

    def dsa_attention(query: Tensor, latent: Tensor, expand, *, topk: int, index=None, selection=None, scale=None,
                      dropout_p: float = 0.0, state=None):
        """A rank holding no piece (padding only) expands the keys it received outside the graph: the sum over
        the ranks is right, the rank gives ``expand``'s weights no gradient."""
        state = active_state(state, query, "dsa_attention")

        def detached_here(rows: Tensor) -> tuple[Tensor, Tensor]:
            keys, values = expand(rows)
            return (keys.detach(), values.detach()) if not state.docs.pieces else (keys, values)

        return _dsa(query, latent, detached_here, topk, index, selection, scale, dropout_p, state, _pieces)

    return dsa_attention


SPEC = MixerSpec(
    layer="sparse", inputs=("q", "latent"), weight_names=("wq", "wl", "wk", "wv", "wo"), weights=_weights,
    block=_block, reference_mix=_reference_mix, impl_mix=_impl_mix, received=_received, exchange="keys",
    check_exchange=_check_exchange,
    label=lambda case: f"dsa top{case.width} {case.hq}x{case.dim} idx{case.hkv}",
    args=lambda case: ["--width", str(case.width)],
    mutants={"topk_over_row": _topk_over_row, "expand_unused": _expand_unused},
)
