"""Shrink a transformers config to a tiny one that keeps what matters for CP: every layer type, every window and
chunk, the attention head ratio, the vision tower and its deepstack levels.

:func:`tiny_config` returns a :class:`Tiny` (the new config, every change as ``path: (old, new)``, and which layers
of each stack were kept). Widths go to a few dozen; token ids above the tiny vocabulary move to its top
(:data:`SPECIAL_TOKENS` ids, never drawn as text); windows and chunks go to :data:`WINDOW` tokens (a short
document crosses them). Depth: every layer is given a signature (its entries in the config's per-layer lists,
its membership in the config's layer index lists, and, when a ``build`` function is given, the structure of its
module: classes and scalar attributes of every submodule), and the stack keeps the first layer of each
signature (at least 2 layers). When the config cannot express that subset (a layer's kind follows from a step
or a count, e.g. ``first_k_dense_replace``), the shortest prefix of the stack that holds every signature is kept.

A config without the fields this shrinks (no width, no layer count) raises :class:`TinyConfigError` naming what
was expected.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["SPECIAL_TOKENS", "VOCAB", "WINDOW", "Tiny", "TinyConfigError", "tiny_config"]

VOCAB = 128
SPECIAL_TOKENS = 16  # the top ids of the tiny vocabulary: special tokens (image, bos, eos, ...) land there
WINDOW = 8  # sliding windows and attention chunks, in tokens
HIDDEN = 64
HEAD_DIM = 16
MAX_HEADS = 8
MIN_LAYERS = 2

HIDDEN_FIELDS = ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "emb_dim")
# the first present is the stack's count; an encoder-decoder's other count follows it when equal
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "depth", "decoder_layers",
                "num_decoder_layers", "encoder_layers", "num_encoder_layers")
PATTERN_FIELDS = ("layers_block_type", "hybrid_override_pattern", "block_types", "layers_block_types")
HEAD_PAIRS = (
    ("num_attention_heads", "num_key_value_heads"), ("n_head", "n_head_kv"), ("num_heads", "num_kv_heads"),
    ("n_heads", "n_kv_heads"), ("num_attention_heads", "multi_query_group_num"),
    ("decoder_attention_heads", "decoder_num_key_value_heads"), ("encoder_attention_heads", "encoder_num_key_value_heads"),
)
# field -> its tiny value (applied only when the original is larger; None values stay None)
FIXED: dict[str, int] = {
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_dim": HEAD_DIM,
    "intermediate_size": 64, "intermediate_size_mlp": 64, "ffn_dim": 64, "n_inner": 64, "d_ff": 64,
    "ffn_hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "expert_ffn_hidden_size": 32, "qk_head_dim": 24,
    "moe_shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    # MLA (DeepSeek)
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    # DeepSeek Sparse Attention's indexer: its top-k below a document's length, so that selection happens
    "index_topk": 4, "index_head_dim": 16, "index_n_heads": 2,
    # GLM5-Next's pooled indexer: pools of 2 keys (its top-k must be a multiple of the pool)
    "index_kpool": 2,
    # state-space and linear attention
    "ssm_state_size": 16, "state_size": 16, "d_state": 16, "mamba_d_state": 16, "mamba_head_dim": 16,
    "chunk_size": WINDOW, "time_step_rank": 8, "dt_rank": 8,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    # Kimi Delta Attention (Kimi Linear, Ling) and GLM5-Next's linear attention: heads of a K x K state each
    "linear_head_dim": HEAD_DIM, "linear_num_heads": MAX_HEADS // 2,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "n_shared_experts": 1,
    "num_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_expert_group": 1, "first_k_dense_replace": 1,
    "first_k_dense": 1,
    # windows and chunks: a short document crosses them
    "sliding_window": WINDOW, "attention_chunk_size": WINDOW, "sliding_window_size": WINDOW,
    "attention_window_size": WINDOW,
    # Llama 4's NoPE temperature: positions from floor_scale on are scaled; a short document reaches it
    "floor_scale": 4,
    # vision towers: out_hidden_size feeds the text model; projectors between tower and text model
    "out_hidden_size": HIDDEN, "vision_output_dim": HIDDEN, "projection_dim": HIDDEN,
    "projector_hidden_size": HIDDEN, "projector_input_dim": HIDDEN, "projector_output_dim": HIDDEN,
    "image_token_embed_dim": HIDDEN, "base_channels": 32, "latent_channels": 32, "num_res_blocks": 1,
    # per-layer input embeddings (Gemma 3n / 4), byte-group hash embeddings (BLT)
    "hidden_size_per_layer_input": 16, "encoder_hash_byte_group_vocab": 256, "vocab_size_per_layer_input": VOCAB,
    # partial rotary (GPT-J, CodeGen): the rotated dims of a head; experts per token (ERNIE)
    "rotary_dim": HEAD_DIM // 2, "moe_k": 2,
    # a vision tower's patches (Inkling's 40 x 40 patch projection is 600k wide at any hidden size)
    "patch_size": 16,
}
# fields a default config leaves None that its model cannot run without, when the config has experts
NONE_FILLS = {"num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}
# lists of widths (one per stage of a tower): scaled together, by a power of two, to at most 2 x HIDDEN
WIDTH_LISTS = ("hidden_sizes", "embed_dim", "dims", "channels", "embed_dims")
# an int field whose original value equals an original width of the config tree is taken as tied to it (a
# tower's ``text_hidden_size``, an adapter's input width) and follows it, unless its name says it is not a width
_NOT_TIED = re.compile(r"position|vocab|token|length|window|max_|seq|chunk|image_size|num_|_id$|index|layers|rank")
VOCAB_FIELDS = ("vocab_size",)  # and every other field whose name ends in "vocab_size"
# a layer's kind follows from these (steps, counts, intervals): the subset of layers cannot be named by lists
STEP_FIELDS = ("first_k_dense_replace", "first_k_dense", "decoder_sparse_step", "moe_layer_freq",
               "interleave_moe_layer_step", "no_rope_layer_interval", "sliding_window_pattern",
               "_sliding_window_pattern", "max_window_layers", "mlp_layer_step", "attn_layer_period",
               "attn_layer_offset", "expert_layer_period", "expert_layer_offset", "full_attention_interval")
# mRoPE sections (rotary pairs per axis: t, h, w) that modeling code assumes when the config names none
MROPE_DEFAULTS = {"qwen2_vl_text": (16, 24, 24), "qwen2_5_vl_text": (16, 24, 24), "qwen3_vl_text": (24, 20, 20),
                  "qwen3_vl_moe_text": (24, 20, 20), "glm4v_text": (8, 12, 12), "glm4v_moe_text": (8, 12, 12),
                  "glm_ocr_text": (8, 12, 12), "paddleocr_vl_text": (16, 24, 24), "qwen2_5_omni_text": (16, 24, 24),
                  "qwen3_omni_moe_text": (24, 20, 20)}
_TOKEN_SUFFIXES = ("_token_id", "_token_index", "_token_ids", "token_id")


class TinyConfigError(ValueError):
    """``--tiny`` was given a config it cannot shrink (no width or layer field, or no tiny version builds)."""


@dataclass
class Tiny:
    """The tiny config, every change (``"text_config.hidden_size": (4096, 64)``) and, per layer stack
    (``"text_config.num_hidden_layers"``), the original indices of the layers kept."""

    config: Any
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    kept_layers: dict[str, list[int]] = field(default_factory=dict)

    def describe(self) -> str:
        stacks = "; ".join(f"{k}: layers {v} of the original" for k, v in self.kept_layers.items())
        return f"{len(self.changes)} fields changed" + (f"; {stacks}" if stacks else "")


# ---- fields of one config ---------------------------------------------------------------------------------
def _init_fields(cfg: Any) -> list[str]:
    if dataclasses.is_dataclass(cfg):
        return [f.name for f in dataclasses.fields(type(cfg)) if f.init]
    return list(cfg.to_dict())


def _values(cfg: Any) -> dict[str, Any]:
    out = {}
    raw = None
    for name in _init_fields(cfg):
        try:
            value = getattr(cfg, name)
        except Exception:  # noqa: BLE001 - a per-layer attribute read globally: its global value, as serialised
            raw = cfg.to_dict() if raw is None else raw
            if name not in raw:
                continue
            value = raw[name]
        if type(value).__name__.endswith("PerLayerConfigView"):  # per-layer overrides: their serialised dict
            raw = cfg.to_dict() if raw is None else raw
            value = raw.get(name, value)
        out[name] = value
    return out


def _default(cls: type, name: str) -> Any:
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
    return dataclasses.MISSING


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_token_field(name: str) -> bool:
    return name.endswith(_TOKEN_SUFFIXES) or name in ("pad_token_id", "bos_token_id", "eos_token_id")


class _Tokens:
    """Token ids beyond the tiny vocabulary -> distinct ids at its top, the same map for every sub-config."""

    def __init__(self) -> None:
        self.map: dict[int, int] = {}

    def __call__(self, v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return type(v)(self(e) for e in v)
        if not _is_int(v) or v < VOCAB - SPECIAL_TOKENS:
            return v
        if v not in self.map:
            if len(self.map) >= SPECIAL_TOKENS:
                raise TinyConfigError(f"--tiny: expected at most {SPECIAL_TOKENS} special token ids, got more")
            self.map[v] = VOCAB - 1 - len(self.map)
        return self.map[v]


def _heads(q: int, kv: int | None) -> tuple[int, int | None]:
    """(query heads, key/value heads) at most MAX_HEADS query heads, keeping the ratio (MHA, GQA, MQA)."""
    if kv is None or kv <= 0:
        return min(q, MAX_HEADS // 2), kv
    if q % kv:
        return min(q, MAX_HEADS // 2), min(kv, MAX_HEADS // 2)
    ratio = q // kv
    if ratio == 1:
        n = min(q, MAX_HEADS // 2)
        return n, n
    kv_t = 2 if ratio * 2 <= MAX_HEADS and kv >= 2 else 1
    return ratio * kv_t, kv_t


def _tiny_hidden(vals: dict[str, Any], model_type: str = "") -> int:
    """The tiny hidden size of one config: :data:`HIDDEN`, or ``heads x HEAD_DIM`` when its tiny query heads do not
    divide it (configs validate that even with an explicit head_dim) or, with mRoPE and no explicit head_dim, would
    leave too few rotary pairs for its three sections (a 16:1 GQA ratio keeps 16 query heads)."""
    for q_name, kv_name in HEAD_PAIRS:
        q = vals.get(q_name)
        if _is_int(q) and q > 0:
            kv = vals.get(kv_name) if _is_int(vals.get(kv_name)) else None
            q_t, _ = _heads(q, kv)
            rp = vals.get("rope_parameters") or vals.get("rope_scaling") or {}
            mrope = isinstance(rp, dict) and bool(rp.get("mrope_section") or MROPE_DEFAULTS.get(model_type))
            partial = (rp.get("partial_rotary_factor") if isinstance(rp, dict) else None) or 1.0
            narrow = mrope and not _is_int(vals.get("head_dim")) and int(HIDDEN // q_t * partial) // 2 < 3
            return q_t * HEAD_DIM if HIDDEN % q_t or narrow else HIDDEN
    return HIDDEN


def _widths(cfg: Any, vals: dict[str, Any], tokens: _Tokens, tied: dict[int, int] | None = None) -> dict[str, Any]:
    """Overrides of one config's own width fields (not its sub-configs, not its depth); ``tied``: the original
    widths of the whole config tree and their tiny values."""
    ov: dict[str, Any] = {}
    tied = tied or {}
    fields = set(vals)
    for name in HIDDEN_FIELDS:
        if _is_int(vals.get(name)) and vals[name] > HIDDEN:
            ov[name] = tied.get(vals[name], _tiny_hidden(vals, getattr(cfg, "model_type", "")))
    done: set[str] = set()
    for q_name, kv_name in sorted(HEAD_PAIRS, key=lambda p: p[1] not in fields):  # pairs present first
        q = vals.get(q_name)
        if q_name in done or not _is_int(q):
            continue
        kv = vals.get(kv_name) if _is_int(vals.get(kv_name)) else None
        if kv is None and kv_name in fields and vals.get(kv_name) is not None:
            continue
        done.add(q_name)
        q_t, kv_t = _heads(q, kv)
        if q_t != q:
            ov[q_name] = q_t
        if kv is not None and kv_t != kv:
            ov[kv_name] = kv_t
    for name, target in FIXED.items():
        v = vals.get(name)
        if name in fields and _is_int(v) and v > target:
            ov[name] = target
        elif name in fields and isinstance(v, (list, tuple)) and v and all(_is_int(e) for e in v) and max(v) > target:
            ov[name] = type(v)(min(e, target) for e in v)  # one value per layer (Gemma 3n's intermediate sizes)
    for name, v in vals.items():
        if (name in VOCAB_FIELDS or name.endswith("vocab_size")) and _is_int(v) and v > VOCAB:
            ov[name] = VOCAB
    for name in WIDTH_LISTS:
        v = vals.get(name)
        if isinstance(v, (list, tuple)) and v and all(_is_int(e) and e > 0 for e in v) and max(v) > 2 * HIDDEN:
            factor = 1
            while max(v) // (factor * 2) >= 2 * HIDDEN or max(v) / factor > 2 * HIDDEN:
                factor *= 2
            ov[name] = type(v)(max(8, e // factor) for e in v)
    for name, v in vals.items():
        if name not in ov and _is_int(v) and v > HIDDEN and v in tied and not _NOT_TIED.search(name):
            ov[name] = tied[v]
    # linear attention: value heads a multiple of key heads, as in the original
    k, v = vals.get("linear_num_key_heads"), vals.get("linear_num_value_heads")
    if _is_int(k) and _is_int(v) and k > 2:
        ov["linear_num_key_heads"] = 2
        ov["linear_num_value_heads"] = 2 * max(1, v // k)
    # Mamba2: heads x head dim is the mixer's width; groups divide the heads
    heads_name = next((n for n in ("mamba_num_heads", "mamba_n_heads") if _is_int(vals.get(n))), None)
    if heads_name is not None and vals[heads_name] > 8:
        ov[heads_name] = 8
        groups = vals.get("n_groups") if "n_groups" in fields else vals.get("mamba_n_groups")
        gname = "n_groups" if "n_groups" in fields else "mamba_n_groups"
        if _is_int(groups) and groups > 1:
            ov[gname] = 2
    if "mamba_d_ssm" in fields and _is_int(vals.get("mamba_d_ssm")):
        ov["mamba_d_ssm"] = 8 * HEAD_DIM
    _ssm_heads(vals, ov)
    for name, v in vals.items():
        if _is_token_field(name):
            new = tokens(v)
            if new != v:
                ov[name] = new
    experts = any(_is_int(vals.get(n)) for n in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"))
    for name, fill in NONE_FILLS.items():
        if experts and name in fields and vals.get(name) is None:
            ov[name] = fill
    for name, v in vals.items():  # per-layer overrides of config fields ({"02": {"num_attention_heads": 64}})
        if isinstance(v, dict) and v and all(isinstance(x, dict) and set(x) <= fields for x in v.values()):
            rest = {f: y for f, y in vals.items() if f != name}
            shrunk = {k: {**x, **{f: y for f, y in _widths(None, {**rest, **x}, tokens, tied).items() if f in x}}
                      for k, x in v.items()}
            if shrunk != v:
                ov[name] = shrunk
    _mrope(vals, ov, getattr(cfg, "model_type", ""))
    return ov


# (SSM heads, SSM head dim, expansion) of a Mamba2 mixer: heads x head dim = expansion x hidden
_SSM_FIELDS = (("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
               ("mamba_num_heads", "mamba_head_dim", "mamba_expand"))


def _ssm_heads(vals: dict[str, Any], ov: dict[str, Any]) -> None:
    """Mamba2's heads and head dim at the tiny width: ``heads x head_dim = expand x hidden`` (configs check it),
    head dim :data:`HEAD_DIM`; its groups divide the heads."""
    hidden = ov.get("hidden_size", vals.get("hidden_size"))
    for heads, dim, expand in _SSM_FIELDS:
        e = vals.get(expand)
        if heads not in vals or not _is_int(hidden) or not isinstance(e, (int, float)) or isinstance(e, bool):
            continue
        if not (_is_int(vals.get(heads)) and (dim not in vals or _is_int(vals.get(dim)) or vals.get(dim) == "auto")):
            continue
        if heads == "num_heads" and "state_size" not in vals and "ssm_state_size" not in vals:
            continue  # attention heads, not a state-space mixer's
        width = int(e * hidden)
        if width % HEAD_DIM:
            continue
        ov[heads] = width // HEAD_DIM
        if dim in vals and _is_int(vals.get(dim)):
            ov[dim] = HEAD_DIM
        for g in ("n_groups", "mamba_n_groups"):
            if _is_int(vals.get(g)) and ov[heads] % ov.get(g, vals[g]):
                ov[g] = 1


def _scaled_section(section: Sequence[int], old_half: int, new_half: int) -> list[int]:
    """An mRoPE section (rotary pairs per axis) scaled to sum to ``new_half``, the tiny head's rotary pairs (the
    modeling code splits exactly that many; a default config's section may not even match its own head)."""
    total = sum(section)
    out = [max(1, round(s * new_half / total)) for s in section]
    out[-1] += new_half - sum(out)
    return out


def _mrope(vals: dict[str, Any], ov: dict[str, Any], model_type: str) -> None:
    if _is_int(vals.get("qk_rope_head_dim")):  # MLA: the rotary part of a head is its own dim
        old_hd, new_hd = vals["qk_rope_head_dim"], ov.get("qk_rope_head_dim", vals["qk_rope_head_dim"])
        for name in ("rope_parameters", "rope_scaling"):
            rp = vals.get(name)
            section = rp.get("mrope_section") if isinstance(rp, dict) else None
            if isinstance(section, (list, tuple)) and new_hd != old_hd:
                ov[name] = {**rp, "mrope_section": _scaled_section(section, old_hd // 2, new_hd // 2)}
        return
    old_hd = vals.get("head_dim")
    if not _is_int(old_hd):
        h, n = vals.get("hidden_size"), vals.get("num_attention_heads")
        old_hd = h // n if _is_int(h) and _is_int(n) and n else None
    if not old_hd:
        return
    new_hd = ov.get("head_dim", old_hd if "head_dim" in vals and _is_int(vals.get("head_dim")) else None)
    if new_hd is None:
        h, n = ov.get("hidden_size", vals.get("hidden_size")), ov.get("num_attention_heads", vals.get("num_attention_heads"))
        new_hd = h // n if _is_int(h) and _is_int(n) and n else old_hd
    for name in ("rope_parameters", "rope_scaling"):
        rp = vals.get(name)
        if not isinstance(rp, dict):
            continue
        section = rp.get("mrope_section") or MROPE_DEFAULTS.get(model_type)
        partial = rp.get("partial_rotary_factor", vals.get("partial_rotary_factor")) or 1.0
        if isinstance(section, (list, tuple)) and (new_hd != old_hd or "mrope_section" not in rp):
            ov[name] = {**rp, "mrope_section": _scaled_section(section, int(old_hd * partial) // 2,
                                                               int(new_hd * partial) // 2)}


def _rebuild(cls: type, base: dict[str, Any], what: str) -> Any:
    try:
        return cls(**base)
    except Exception as exc:  # noqa: BLE001 - any failure of the config class is reported as one line
        raise TinyConfigError(f"--tiny: expected {cls.__name__} to accept its shrunk fields ({what}), got "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def _derived(cls: type, vals: dict[str, Any]) -> list[str]:
    """Fields whose default is None and whose value the config derives from the others (head_dim from the
    hidden size, ...): reset to None in the tiny config, so that they follow the tiny widths."""
    out = []
    for name, v in vals.items():
        if v is None or isinstance(v, (dict, list, tuple, str, bool)) or _default(cls, name) is not None:
            continue
        try:
            again = cls(**{**vals, name: None})
        except Exception:  # noqa: BLE001 - not derivable that way
            continue
        if getattr(again, name, None) == v:
            out.append(name)
    return out


def _tree_widths(cfg: Any, out: dict[int, int] | None = None) -> dict[int, int]:
    """The original hidden widths of a config and its sub-configs -> their tiny values (what :func:`_widths`
    ties other fields to); the first config holding a width decides its tiny value."""
    out = {} if out is None else out
    vals = _values(cfg)
    for n in HIDDEN_FIELDS:
        if _is_int(vals.get(n)) and vals[n] > HIDDEN:
            out.setdefault(vals[n], _tiny_hidden(vals, getattr(cfg, "model_type", "")))
    for n in getattr(cfg, "sub_configs", None) or {}:
        if hasattr(vals.get(n), "to_dict"):
            _tree_widths(vals[n], out)
    return out


def _shrink_widths(cfg: Any, path: str, tokens: _Tokens, changes: dict[str, tuple[Any, Any]],
                   tied: dict[int, int] | None = None) -> Any:
    cls = type(cfg)
    vals = _values(cfg)
    tied = _tree_widths(cfg) if tied is None else tied
    subs = [n for n in (getattr(cfg, "sub_configs", None) or {}) if hasattr(vals.get(n), "to_dict")]
    base = {k: v for k, v in vals.items() if k not in subs}
    for name in _derived(cls, base):
        base[name] = None
    for name in subs:
        base[name] = _shrink_widths(vals[name], f"{path}{name}.", tokens, changes, tied)
    ov = _widths(cfg, vals, tokens, tied)
    for k, v in ov.items():
        changes[path + k] = (_short(vals.get(k)), _short(v))
    base.update(ov)
    return _rebuild(cls, base, ", ".join(f"{path}{k}" for k in ov) or "none")


def _short(v: Any) -> Any:
    text = json.dumps(v, default=str) if not isinstance(v, str) else v
    return v if len(text) <= 80 else text[:77] + "..."


# ---- depth ------------------------------------------------------------------------------------------------
def _layer_count(vals: dict[str, Any]) -> tuple[str | None, int | None]:
    for name in LAYER_FIELDS:
        if _is_int(vals.get(name)) and vals[name] > 0:
            return name, vals[name]
    for name in PATTERN_FIELDS:
        v = vals.get(name)
        if isinstance(v, (list, tuple, str)) and len(v) > 0:
            return name, len(v)
    return None, None


def _layer_lists(vals: dict[str, Any], n: int, kinds: dict[str, str] | None = None
                 ) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """(per-layer fields: a value per layer, index fields: sorted layer indices) of one config. ``kinds`` (field ->
    "per_layer" | "index", from the original config) settles lists that could be either (``[1, 0]``)."""
    per_layer, index = {}, {}
    for name, v in vals.items():
        if _is_token_field(name) or name in LAYER_FIELDS:
            continue
        kind = (kinds or {}).get(name)
        if kinds is not None and kind is None:
            continue
        if isinstance(v, str) and name in PATTERN_FIELDS and len(v) == n:
            per_layer[name] = v
        elif isinstance(v, (list, tuple)):
            ints = all(_is_int(e) for e in v)
            as_index = ints and len(set(v)) == len(v) and all(0 <= e < n for e in v) and (len(v) < n or sorted(v) == list(range(n)))
            if kind == "index" or kind is None and as_index:
                index[name] = sorted(v)
            elif (kind == "per_layer" or kind is None) and len(v) == n and n >= 2:
                per_layer[name] = list(v)
    return per_layer, index


def _kinds(vals: dict[str, Any], n: int) -> dict[str, str]:
    per_layer, index = _layer_lists(vals, n)
    return {**{k: "per_layer" for k in per_layer}, **{k: "index" for k in index}}


def _config_signatures(vals: dict[str, Any], n: int, kinds: dict[str, str] | None = None) -> list[tuple]:
    """Per layer: its entry in every per-layer field, and for every index field whether it is the list's first
    member (1), a later one (2) or none (0); first and later differ only in a list holding some layers but not
    all (deepstack levels, full-attention blocks of a windowed tower), so that two of its members stay."""
    per_layer, index = _layer_lists(vals, n, kinds)

    def member(f: str, i: int) -> int:
        v = index[f]
        if i not in v:
            return 0
        return 1 if (v.index(i) == 0 or not 1 < len(v) < n) else 2

    return [
        tuple(json.dumps(per_layer[f][i], default=str) for f in sorted(per_layer)) + tuple(member(f, i) for f in sorted(index))
        for i in range(n)
    ]


def _subset(vals: dict[str, Any], count_field: str, n: int, keep: list[int], kinds: dict[str, str]) -> dict[str, Any]:
    """The config's fields with only layers ``keep`` (original indices, sorted)."""
    per_layer, index = _layer_lists(vals, n, kinds)
    out = dict(vals)
    if count_field in LAYER_FIELDS:
        out[count_field] = len(keep)
    for f, v in per_layer.items():
        out[f] = "".join(v[i] for i in keep) if isinstance(v, str) else [v[i] for i in keep]
    for f, v in index.items():
        out[f] = [keep.index(i) for i in v if i in keep]
    for name in LAYER_FIELDS:
        if name != count_field and vals.get(name) == n:
            out[name] = len(keep)
    return out


ModuleSignatures = Callable[[Any], dict[str, list[tuple]]]  # config -> {config path: a signature per layer}


def _kept(cfg: Any, path: str, module_sigs: dict[str, list[tuple]] | None, build_sigs: ModuleSignatures | None,
          root: Any, changes: dict, kept: dict[str, list[int]]) -> Any:
    """``cfg`` (already at tiny widths) with a shorter stack of layers, recursively for its sub-configs."""
    cls = type(cfg)
    vals = _values(cfg)
    subs = [n for n in (getattr(cfg, "sub_configs", None) or {}) if hasattr(vals.get(n), "to_dict")]
    for name in subs:
        vals[name] = _kept(vals[name], f"{path}{name}.", module_sigs, build_sigs, root, changes, kept)
    count_field, n = _layer_count(vals)
    if count_field is None or n <= MIN_LAYERS:
        return _rebuild(cls, vals, "sub-configs") if subs else cfg
    kinds = _kinds(vals, n)
    cfg_sigs = _config_signatures(vals, n, kinds)
    mod = (module_sigs or {}).get(path)
    sigs = [a + b for a, b in zip(cfg_sigs, mod)] if mod is not None and len(mod) == n else cfg_sigs
    keep: list[int] = []
    seen: set = set()
    for i, s in enumerate(sigs):
        if s not in seen:
            seen.add(s)
            keep.append(i)
    for i in range(n):  # at least MIN_LAYERS, so that a layer's output feeds another layer
        if len(keep) >= MIN_LAYERS:
            break
        if i not in keep:
            keep.append(i)
    keep.sort()
    # the first layer of each kind; else the shortest prefix holding every kind (a kind may follow from a step)
    candidates = [keep] + [list(range(k)) for k in range(max(MIN_LAYERS, len(seen)), n + 1) if list(range(k)) != keep]
    for cand in candidates:
        try:
            new = _carry(cfg, _rebuild(cls, _subset(vals, count_field, n, cand, kinds), f"{path}{count_field}={len(cand)}"))
        except TinyConfigError:  # the config class refuses this subset: the next candidate may do
            continue
        if _covers(new, path, kinds, set(cfg_sigs), set(sigs) if sigs is not cfg_sigs else None, build_sigs, root):
            changes[path + count_field] = (n, len(cand))
            kept[path + count_field] = cand
            return new
    raise TinyConfigError(f"--tiny: expected a stack of at most {n} layers of {cls.__name__} keeping every layer "
                          f"type ({len(seen)} kinds), found none")


def _covers(new: Any, path: str, kinds: dict[str, str], want_cfg: set, want_all: set | None, build_sigs: ModuleSignatures | None,
            root: Any) -> bool:
    """Whether the candidate config's layers have every signature of the original (config, and modules when
    ``want_all`` is given)."""
    vals = _values(new)
    _, k = _layer_count(vals)
    got = _config_signatures(vals, k, kinds)
    if not set(got) >= want_cfg:
        return False
    if want_all is None or build_sigs is None:
        return True
    try:
        mod = build_sigs(_with(root, path, new)).get(path)
    except TinyConfigError:  # this subset does not build: the next candidate may
        return False
    if mod is None or len(mod) != k:
        return False
    return {a + b for a, b in zip(got, mod)} >= want_all


def _with(root: Any, path: str, sub: Any) -> Any:
    """``root`` with the sub-config at ``path`` ("text_config.") replaced by ``sub`` (a copy)."""
    if not path:
        return sub
    import copy

    out = copy.copy(root)
    parts = path.rstrip(".").split(".")
    holder = out
    for p in parts[:-1]:
        child = copy.copy(getattr(holder, p))
        setattr(holder, p, child)
        holder = child
    setattr(holder, parts[-1], sub)
    return out


# ---- module signatures ----------------------------------------------------------------------------------
def module_signatures(model: nn.Module, config: Any) -> dict[str, list[tuple]]:
    """{config path: per layer, the classes and scalar attributes of every submodule} for each layer stack of
    ``config`` whose ``nn.ModuleList`` of that length is found in ``model`` (attributes equal to the layer's index
    are left out: they name the layer, not its kind)."""
    stacks: dict[str, int] = {}

    def visit(cfg: Any, path: str) -> None:
        vals = _values(cfg)
        _, n = _layer_count(vals)
        if n:
            stacks[path] = n
        for name in getattr(cfg, "sub_configs", None) or {}:
            if hasattr(vals.get(name), "to_dict"):
                visit(vals[name], f"{path}{name}.")

    visit(config, "")
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    out: dict[str, list[tuple]] = {}
    for path, n in stacks.items():
        matches = [m for m in lists if len(m) == n and len({type(x).__name__ for x in m}) <= n]
        if not matches or len({n2 for n2 in stacks.values() if n2 == n}) > 1:
            continue
        per_layer = [[] for _ in range(n)]
        for ml in matches:
            for i, layer in enumerate(ml):
                per_layer[i].append(_structure(layer))
        out[path] = _drop_indices([tuple(p) for p in per_layer])
    return out


def _structure(layer: nn.Module) -> tuple:
    items = []
    for name, m in layer.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(m).items()
                             if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, float, str, type(None)))))
        items.append((name, type(m).__name__, attrs))
    return tuple(items)


def _drop_indices(sigs: list[tuple]) -> list[tuple]:
    """Remove attributes (by name) whose integer value is the layer's index (or index + 1) wherever they occur:
    they name the layer, not its kind."""
    n = len(sigs)
    if n < 2:
        return sigs

    def values(sig: tuple, attr: str) -> list:
        return [v for stack in sig for (_, _, attrs) in stack for (k, v) in attrs if k == attr]

    names = {k for sig in sigs for stack in sig for (_, _, attrs) in stack for (k, v) in attrs if _is_int(v)}
    index_like = set()
    for attr in names:
        present = [(i, values(sig, attr)) for i, sig in enumerate(sigs)]
        present = [(i, vs) for i, vs in present if vs]
        for step, off in ((1, 0), (1, 1), (2, 0), (2, 1)):  # i, i + 1; 2i, 2i + 1 (two sub-layers per layer)
            if len(present) >= 2 and all(all(v == step * i + off for v in vs) for i, vs in present):
                index_like.add(attr)
    if not index_like:
        return sigs
    return [
        tuple(tuple((name, cls, tuple(a for a in attrs if a[0] not in index_like)) for (name, cls, attrs) in stack)
              for stack in sig)
        for sig in sigs
    ]


# ---- entry ------------------------------------------------------------------------------------------------
def tiny_config(config: Any, *, build: Callable[[Any], nn.Module] | None = None) -> Tiny:
    """A tiny copy of ``config`` (see the module docstring). ``build(config)`` builds a model (on the meta device
    is enough) whose layer structure joins the layer signatures; without it, only the config's per-layer lists
    and index lists tell layers apart."""
    if not hasattr(config, "to_dict"):
        raise TinyConfigError(f"--tiny: expected a transformers config, got {type(config).__name__}")
    changes: dict[str, tuple[Any, Any]] = {}
    widths = _settle(_shrink_widths(config, "", _Tokens(), changes))
    if not _has_layers(widths) or not _has_width(widths):
        raise TinyConfigError(
            f"--tiny: expected a config with a width ({', '.join(HIDDEN_FIELDS)}) and a layer count "
            f"({', '.join(LAYER_FIELDS + PATTERN_FIELDS)}), got {type(config).__name__} without "
            + ("a layer count" if not _has_layers(widths) else "a width field")
            + " (other names are not shrunk; give a config.json already small, without --tiny)"
        )
    build_sigs: ModuleSignatures | None = None
    module_sigs = None
    if build is not None:
        def signatures(cfg: Any) -> dict[str, list[tuple]]:
            try:
                return module_signatures(build(cfg), cfg)
            except Exception as exc:  # noqa: BLE001 - the model class's complaint, in one line
                text = str(exc).strip().splitlines()
                raise TinyConfigError(f"--tiny: expected the shrunk {type(cfg).__name__} to build a model, got "
                                      f"{type(exc).__name__}: {text[0] if text else ''}") from None

        build_sigs = signatures
        module_sigs = build_sigs(widths)
    kept: dict[str, list[int]] = {}
    tiny = _kept(widths, "", module_sigs, build_sigs, widths, changes, kept)
    return Tiny(config=tiny, changes=changes, kept_layers=kept)


def _carry(old: Any, new: Any) -> Any:
    """``new`` with the attributes ``old`` has and ``new`` lacks (set on a sub-config by its parent's
    ``__post_init__``, e.g. PaliGemma's ``vision_config.projection_dim``, not a field of the sub-config)."""
    for k, v in vars(old).items():
        if not k.startswith("_") and k not in vars(new):
            setattr(new, k, v)
    return new


def _settle(cfg: Any) -> Any:
    """``cfg`` rebuilt from its own fields until that changes nothing (a config deriving a field from another in
    ``__post_init__``, e.g. a linear-attention head dim from ``head_dim``, which MLA configs then reset, gives
    another config when built again from its values: the layer subsets are built that way, so the full stack
    must be too)."""
    cls = type(cfg)
    for _ in range(3):
        vals = _values(cfg)
        for name in getattr(cfg, "sub_configs", None) or {}:
            if hasattr(vals.get(name), "to_dict"):
                vals[name] = _settle(vals[name])
        try:
            again = _carry(cfg, cls(**vals))
        except Exception:  # noqa: BLE001 - a config that does not take its own fields back stays as it is
            return cfg
        if json.dumps(again.to_dict(), sort_keys=True, default=str) == json.dumps(cfg.to_dict(), sort_keys=True, default=str):
            return again
        cfg = again
    return cfg


def _has_layers(cfg: Any) -> bool:
    vals = _values(cfg)
    if _layer_count(vals)[0] is not None:
        return True
    return any(_has_layers(vals[n]) for n in (getattr(cfg, "sub_configs", None) or {}) if hasattr(vals.get(n), "to_dict"))


def _has_width(cfg: Any) -> bool:
    vals = _values(cfg)
    if any(_is_int(vals.get(n)) for n in HIDDEN_FIELDS):
        return True
    return any(_has_width(vals[n]) for n in (getattr(cfg, "sub_configs", None) or {}) if hasattr(vals.get(n), "to_dict"))
