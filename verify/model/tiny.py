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

HIDDEN_FIELDS = ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim")
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "depth")
PATTERN_FIELDS = ("layers_block_type", "hybrid_override_pattern", "block_types", "layers_block_types")
HEAD_PAIRS = (
    ("num_attention_heads", "num_key_value_heads"), ("n_head", "n_head_kv"), ("num_heads", "num_kv_heads"),
    ("n_heads", "n_kv_heads"), ("num_attention_heads", "multi_query_group_num"),
)
# field -> its tiny value (applied only when the original is larger; None values stay None)
FIXED: dict[str, int] = {
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_dim": HEAD_DIM,
    "intermediate_size": 64, "intermediate_size_mlp": 64, "ffn_dim": 64, "n_inner": 64, "d_ff": 64,
    "ffn_hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    # MLA (DeepSeek)
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    # state-space and linear attention
    "ssm_state_size": 16, "state_size": 16, "d_state": 16, "mamba_d_state": 16, "mamba_head_dim": 16,
    "chunk_size": WINDOW, "time_step_rank": 8, "dt_rank": 8,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16,
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
    # vision towers: out_hidden_size feeds the text model
    "out_hidden_size": HIDDEN, "vision_output_dim": HIDDEN, "projection_dim": HIDDEN,
}
VOCAB_FIELDS = ("vocab_size",)
# a layer's kind follows from these (steps, counts, intervals): the subset of layers cannot be named by lists
STEP_FIELDS = ("first_k_dense_replace", "first_k_dense", "decoder_sparse_step", "moe_layer_freq",
               "interleave_moe_layer_step", "no_rope_layer_interval", "sliding_window_pattern",
               "_sliding_window_pattern", "max_window_layers", "mlp_layer_step", "attn_layer_period",
               "attn_layer_offset", "expert_layer_period", "expert_layer_offset", "full_attention_interval")
# mRoPE sections (rotary pairs per axis: t, h, w) that modeling code assumes when the config names none
MROPE_DEFAULTS = {"qwen2_vl_text": (16, 24, 24), "qwen2_5_vl_text": (16, 24, 24), "qwen3_vl_text": (24, 20, 20),
                  "qwen3_vl_moe_text": (24, 20, 20)}
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
    for name in _init_fields(cfg):
        try:
            out[name] = getattr(cfg, name)
        except Exception:  # noqa: BLE001 - e.g. a per-layer attribute read globally: not a field to shrink
            continue
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


def _widths(cfg: Any, vals: dict[str, Any], tokens: _Tokens) -> dict[str, Any]:
    """Overrides of one config's own width fields (not its sub-configs, not its depth)."""
    ov: dict[str, Any] = {}
    fields = set(vals)
    for name in HIDDEN_FIELDS:
        if _is_int(vals.get(name)) and vals[name] > HIDDEN:
            ov[name] = HIDDEN
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
    for name in VOCAB_FIELDS:
        if _is_int(vals.get(name)) and vals[name] > VOCAB:
            ov[name] = VOCAB
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
    for name, v in vals.items():
        if _is_token_field(name):
            new = tokens(v)
            if new != v:
                ov[name] = new
    _mrope(vals, ov, getattr(cfg, "model_type", ""))
    return ov


def _scaled_section(section: Sequence[int], old_half: int, new_half: int) -> list[int]:
    """An mRoPE section (rotary pairs per axis, summing to head_dim / 2) scaled to a new head dim."""
    total = sum(section)
    out = [max(1, round(s * new_half / old_half)) for s in section]
    out[-1] += (new_half if total == old_half else round(total * new_half / old_half)) - sum(out)
    return out


def _mrope(vals: dict[str, Any], ov: dict[str, Any], model_type: str) -> None:
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
        if isinstance(section, (list, tuple)) and (new_hd != old_hd or "mrope_section" not in rp):
            ov[name] = {**rp, "mrope_section": _scaled_section(section, old_hd // 2, new_hd // 2)}


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


def _shrink_widths(cfg: Any, path: str, tokens: _Tokens, changes: dict[str, tuple[Any, Any]]) -> Any:
    cls = type(cfg)
    vals = _values(cfg)
    subs = [n for n in (getattr(cfg, "sub_configs", None) or {}) if hasattr(vals.get(n), "to_dict")]
    base = {k: v for k, v in vals.items() if k not in subs}
    for name in _derived(cls, base):
        base[name] = None
    for name in subs:
        base[name] = _shrink_widths(vals[name], f"{path}{name}.", tokens, changes)
    ov = _widths(cfg, vals, tokens)
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
            new = _rebuild(cls, _subset(vals, count_field, n, cand, kinds), f"{path}{count_field}={len(cand)}")
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
        for off in (0, 1):
            present = [(i, values(sig, attr)) for i, sig in enumerate(sigs)]
            present = [(i, vs) for i, vs in present if vs]
            if len(present) >= 2 and all(all(v == i + off for v in vs) for i, vs in present):
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
    widths = _shrink_widths(config, "", _Tokens(), changes)
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
