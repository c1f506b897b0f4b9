"""Which model: a transformers model type or a ``config.json``, optionally shrunk (``--tiny``), and the presets
of ``make verify-models``.

:func:`resolve` turns a ``--model`` argument into a :class:`Prepared` model (its config, tiny or not, the
transformers class that builds it, the stock attention of its reference); :func:`build` builds it with weights
from one seed. Every problem with the argument is a :class:`ModelSpecError` (a ``ValueError``) naming what was
expected, raised before anything runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .tiny import Tiny, TinyConfigError, tiny_config

__all__ = ["AUTO_SUFFIXES", "PRESETS", "ModelSpecError", "Prepared", "Preset", "build", "resolve", "split_auto"]

SEED = 0


class ModelSpecError(ValueError):
    """The ``--model`` argument cannot be turned into a model: unknown type, unreadable or unbuildable config."""


@dataclass(frozen=True)
class Preset:
    """A model of ``make verify-models``: a transformers model type, shrunk, with config overrides (dotted paths
    into sub-configs) applied after shrinking, and what it exercises; ``base``: fields given to the config class
    before shrinking (a sub-config its default lacks, e.g. Gemma 4's vision config).

    ``float64_islands``: module classes the model computes in float32 whatever its dtype, run in float64 on both
    sides of every float64 case (the truth, its baselines and the step under CP:
    :func:`~verify.model.precision.float64_islands`): their float32 rounding depends on the batch's shape and on
    the order of the implementation's own float32 sums, which no single-device baseline reproduces, so the
    float64 limit of 1e-10 would judge the model's rounding, not CP. Float32 cases run them as written."""

    model_type: str
    what: str
    overrides: tuple[tuple[str, Any], ...] = ()
    base: tuple[tuple[str, Any], ...] = ()
    float64_islands: tuple[str, ...] = ()


# what DeepSeek-V4 computes in float32 whatever its dtype: the hyper-connections' mixing (``fn.float()`` matrix
# products) and head, its RMSNorms, and inside its attention the compressors' gate softmax and the indexer's scores
DSV4_FLOAT32_ISLANDS = ("DeepseekV4HyperConnection", "DeepseekV4HyperHead", "DeepseekV4RMSNorm",
                        "DeepseekV4UnweightedRMSNorm", "DeepseekV4Attention")

PRESETS: dict[str, Preset] = {
    "llama": Preset("llama", "dense decoder, GQA, RoPE", (("num_attention_heads", 8), ("num_key_value_heads", 2))),
    "qwen3": Preset("qwen3", "q/k norms"),
    "mistral": Preset("mistral", "sliding window on every layer"),
    "gemma3": Preset("gemma3_text", "sliding and global layers, custom scaling"),
    "qwen3_moe": Preset("qwen3_moe", "mixture of experts (router softmax)"),
    "deepseek_v3": Preset("deepseek_v3", "MLA (Dv != Dqk), dense then MoE layers"),
    "qwen3_next": Preset("qwen3_next", "Gated DeltaNet linear attention + short convolution + attention, MoE"),
    "nemotron_h": Preset("nemotron_h", "Mamba2 + attention + MLP + MoE layers"),
    "kimi_linear": Preset("kimi_linear", "Kimi Delta Attention (per-channel decay) + short convolution + MLA, MoE"),
    "bailing_hybrid": Preset("bailing_hybrid", "Ling: Kimi Delta Attention with a bounded (safe) decay gate + MLA, "
                             "grouped MoE"),
    "jamba": Preset("jamba", "Mamba1 selective scan (RMSNorms of dt, B, C) + attention without positions, MoE"),
    "falcon_mamba": Preset("falcon_mamba", "Mamba1 selective scan only (weightless norms of dt, B, C): no attention"),
    "mamba": Preset("mamba", "Mamba1 selective scan only: no attention"),
    "minimax": Preset("minimax", "lightning attention (a fixed decay per head) + softmax attention, MoE"),
    "qwen2_5_vl": Preset("qwen2_5_vl", "vision-language: vision tower (windowed and full blocks), mRoPE"),
    "qwen3_vl": Preset("qwen3_vl", "vision-language: vision tower with deepstack levels, mRoPE"),
    # images of 8 x 8 pixels, 4 image tokens (Gemma 3: 4 x 4 patches pooled to 2 x 2; PaliGemma: 4 x 4-pixel patches)
    "gemma3_vl": Preset("gemma3", "vision-language: each image's tokens attend bidirectionally within the image "
                        "(token_type_ids), sliding and global layers",
                        (("vision_config.image_size", 8), ("vision_config.patch_size", 2), ("mm_tokens_per_image", 4))),
    "paligemma": Preset("paligemma", "vision-language: a bidirectional prefix of image and prompt (token_type_ids)",
                        (("vision_config.image_size", 8), ("vision_config.patch_size", 4),
                         ("text_config.num_image_tokens", 4))),
    # Gemma 4 (no vision tower): an image is 4 patches of 2 x 2 pixels, one token each; a sliding window of 2,
    # shorter than an image (its sliding layers let an image's tokens see the whole image beyond the window); every
    # layer of head dim 16 (no per-layer head dim: the full layers' is 512 by default), the last two layers reusing
    # the first two's keys and values, the full layers' values equal to their keys (attention_k_eq_v)
    "gemma4": Preset("gemma4_unified", "vision-language without a vision tower (patches embedded one by one): each "
                     "image's tokens attend bidirectionally within the image (mm_token_type_ids), also beyond the "
                     "sliding window",
                     (("vision_config.patch_size", 2), ("vision_config.pooling_kernel_size", 1),
                      ("vision_config.mm_embed_dim", 16), ("vision_config.mm_posemb_size", 8),
                      ("vision_config.output_proj_dims", 16), ("text_config.sliding_window", 2),
                      ("text_config.num_kv_shared_layers", 2), ("text_config.attention_k_eq_v", True),
                      ("text_config.per_layer_config", {})),
                     base=(("vision_config", {}), ("audio_config", None))),
    "gpt_oss": Preset("gpt_oss", "attention sinks, sliding and full layers, MoE"),
    "llama4": Preset("llama4_text", "as released: chunked attention, NoPE layers with temperature tuning, MoE",
                     (("attn_temperature_tuning", True),)),
    "gemma2": Preset("gemma2", "logit soft-capping (attention and final), sliding and global layers"),
    "bloom": Preset("bloom", "ALiBi position bias"),
    "deepseek_v32": Preset("deepseek_v32", "DeepSeek Sparse Attention: the indexer's top-4 of each query's document "
                           "prefix, MLA over the selected keys"),
    "glm_moe_dsa": Preset("glm_moe_dsa", "GLM-5: DSA with a shared-indexer layer (reuses the previous layer's top-k)",
                          (("indexer_types", ["full", "shared"]),)),
    "axk2": Preset("axk2", "A.X-K2: DSA with gated queries (one projection gives the queries and a sigmoid output "
                   "gate), gated RMSNorms"),
    "hy_v4": Preset("hy_v4", "HY-V4: DSA with per-head sinks, an output gate, a shared-indexer layer, hyper-connections "
                    "(a float32 residual stream)"),
    "hy_v4_vl": Preset("hy_v4_vl", "HY-V4-VL on text: HY-V4's DSA layers with mRoPE"),
    "mistral_large4": Preset("mistral_large4", "Mistral Large 4 on text: DSA with position-scaled queries, a NoPE layer, "
                             "a shared-indexer layer, KV sharing (a layer reuses an earlier layer's latent)",
                             (("text_config.num_hidden_layers", 4),
                              ("text_config.indexer_types", ["full", "shared", "full", "full"]),
                              ("text_config.no_rope_layers", [1, 1, 0, 0]), ("text_config.kv_source_layers", [0, 1, 2, 2]),
                              ("text_config.mlp_layer_types", ["dense", "sparse", "sparse", "sparse"]),
                              ("text_config.layer_types", ["indexed_attention"] * 4))),
    "deepseek_v4": Preset("deepseek_v4", "DeepSeek-V4: compressed blocks (HCA windows of 8, CSA overlapping windows "
                          "of 4 with an indexer's top-4), sliding window with sinks, hyper-connections, MoE",
                          (("layer_types", ["heavily_compressed_attention", "compressed_sparse_attention",
                                            "sliding_attention"]),
                           ("compress_rates", {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}),
                           ("num_attention_heads", 4), ("o_groups", 2), ("o_lora_rank", 16), ("hc_mult", 2),
                           # learned routing: the hash layers' table is zeros from the config (both slots expert 0),
                           # which leaves their router a gradient of rounding only
                           ("mlp_layer_types", ["moe", "moe", "moe"])),
                          float64_islands=DSV4_FLOAT32_ISLANDS),
}


@dataclass
class Prepared:
    """A model ready to build: its config (tiny when asked), its transformers auto class, whether it is a
    vision-language model, and the stock attention of the reference (``sdpa`` where the class supports it,
    else ``eager``)."""

    name: str
    config: Any
    auto: str  # "AutoModelForCausalLM" | "AutoModelForImageTextToText"
    multimodal: bool  # the documents hold images (the model's own forward on the multimodal batch)
    reference_attention: str
    tiny: Tiny | None = None
    text_only: str | None = None  # a vision-language model run on text only: why verify builds no images for it
    preset: Preset | None = None
    args: list[str] = field(default_factory=list)  # the command-line arguments that name this model

    @property
    def model_class(self) -> type:
        import transformers

        mapping = getattr(transformers, self.auto)._model_mapping
        return mapping[type(self.config)]


def _load_config(source: str, **fields: Any) -> Any:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if source.endswith(".json") or os.sep in source or os.path.isdir(source):
        path = os.path.join(source, "config.json") if os.path.isdir(source) else source
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as exc:
            raise ModelSpecError(f"--model: expected a readable config.json, got {path!r} ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise ModelSpecError(f"--model: expected a JSON config in {path!r}, got invalid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise ModelSpecError(f"--model: expected a config.json with a 'model_type' field, got none in {path!r}")
        kind = data.pop("model_type")
        if kind not in CONFIG_MAPPING:
            raise ModelSpecError(f"--model: expected a model_type transformers knows, got {kind!r} in {path!r}")
        try:
            return AutoConfig.for_model(kind, **data)
        except Exception as exc:  # noqa: BLE001 - the config class's own complaint, in one line
            raise ModelSpecError(f"--model: expected a valid {kind} config in {path!r}, got {type(exc).__name__}: "
                                 f"{_first_line(exc)}") from None
    if source not in CONFIG_MAPPING:
        close = sorted(k for k in CONFIG_MAPPING if source.replace("-", "_").lower() in k)[:5]
        hint = f" (close: {', '.join(close)})" if close else ""
        raise ModelSpecError(f"--model: expected a preset ({', '.join(PRESETS)}), a transformers model type or a "
                             f"path to a config.json, got {source!r}{hint}")
    return AutoConfig.for_model(source, **fields)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _set(config: Any, path: str, value: Any) -> None:
    holder = config
    *parents, leaf = path.split(".")
    for p in parents:
        holder = getattr(holder, p)
    setattr(holder, leaf, value)


def _no_dropout(config: Any) -> None:
    """Every dropout probability of the config (and its sub-configs) to 0: a step is compared, not sampled
    (``*dropout*``, ``attn_pdrop``, ``decoder_layerdrop``, ``drop_path_rate``: any float field naming a drop, and
    a router's ``*jitter*`` noise)."""
    for name, value in list(vars(config).items()):
        if ("drop" in name or "jitter" in name) and isinstance(value, float) and value > 0:
            setattr(config, name, 0.0)  # jitter: a router's noise in training mode (PhiMoE)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _no_dropout(value)


# ``--model TYPE:SUFFIX``: which transformers auto class builds a model type that both mappings hold
AUTO_SUFFIXES = {"causal-lm": "AutoModelForCausalLM", "image-text-to-text": "AutoModelForImageTextToText"}


def _builds(auto: str, config: Any) -> bool:
    """Whether transformers' ``auto`` class builds ``config`` (its mapping's ``in`` misses a few, e.g. Evolla)."""
    import transformers

    try:
        getattr(transformers, auto)._model_mapping[type(config)]
    except (KeyError, ValueError, AttributeError):
        return False
    return True


def _auto_class(config: Any, auto: str | None = None) -> tuple[str, bool]:
    multimodal = hasattr(config, "vision_config") and getattr(config, "vision_config") is not None
    order = ("AutoModelForImageTextToText", "AutoModelForCausalLM")[:: 1 if multimodal else -1]
    if auto is not None:
        if not _builds(auto, config):
            raise ModelSpecError(f"--model: expected a model type that {auto} builds, got {type(config).__name__}")
        return auto, multimodal and auto == "AutoModelForImageTextToText"
    for auto in order:
        if _builds(auto, config):
            return auto, multimodal and auto == "AutoModelForImageTextToText"
    raise ModelSpecError(f"--model: expected a causal language model (or an image-text-to-text model), got "
                         f"{type(config).__name__}, which transformers builds as neither")


def split_auto(model: str) -> tuple[str, str | None]:
    """``"llama4:causal-lm"`` -> ``("llama4", "AutoModelForCausalLM")``; a name without a suffix -> ``(name, None)``."""
    base, sep, suffix = model.rpartition(":")
    if not sep or suffix not in AUTO_SUFFIXES or os.sep in suffix:
        return model, None
    return base, AUTO_SUFFIXES[suffix]


def meta_build(prepared_auto: str):
    """A ``build(config)`` for :func:`~verify.model.tiny.tiny_config`: the model on the meta device."""

    def build_on_meta(config: Any) -> nn.Module:
        import transformers

        cls = getattr(transformers, prepared_auto)._model_mapping[type(config)]
        with torch.device("meta"):
            return cls._from_config(config)

    return build_on_meta


def resolve(model: str, *, tiny: bool = False) -> Prepared:
    """A preset name, a transformers model type (``TYPE:causal-lm`` / ``TYPE:image-text-to-text`` to pick the auto
    class of a type both mappings hold) or a path to a ``config.json`` -> :class:`Prepared`. A preset is always
    tiny. A vision-language model whose image inputs verify does not build (:func:`~verify.model.multimodal.
    images_unsupported`) runs on text only (``text_only`` says why). Raises :class:`ModelSpecError` (and :class:`~verify.model.tiny.TinyConfigError`, a ValueError)."""
    preset = PRESETS.get(model)
    source, forced = split_auto(model) if preset is None else (model, None)
    config = _load_config(preset.model_type, **dict(preset.base)) if preset else _load_config(source)
    auto, multimodal = _auto_class(config, forced)
    shrunk = None
    if preset is not None or tiny:
        try:
            shrunk = tiny_config(config, build=meta_build(auto))
        except TinyConfigError:
            raise
        config = shrunk.config
    for path, value in preset.overrides if preset else ():
        _set(config, path, value)
    _no_dropout(config)
    if auto == "AutoModelForCausalLM" and getattr(config, "is_decoder", None) is False and not getattr(
            config, "is_encoder_decoder", False):
        config.is_decoder = True  # an encoder's causal-LM head (BERT-style) is a decoder only with it (causal masks)
        if shrunk is not None:
            shrunk.changes["is_decoder"] = (False, True)
    try:
        meta_build(auto)(config)  # a config that cannot build a model is a usage error, found before anything runs
    except Exception as exc:  # noqa: BLE001 - the model class's own complaint, in one line
        raise ModelSpecError(f"--model {model}: expected {type(config).__name__} to build a model, got "
                             f"{type(exc).__name__}: {_first_line(exc)}") from None
    text_only = None
    if multimodal:
        from .multimodal import images_unsupported

        text_only = images_unsupported(config, meta_build(auto)(config))
        multimodal = text_only is None
    cls = getattr(__import__("transformers"), auto)._model_mapping[type(config)]
    attention = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    args = ["--model", model] + (["--tiny"] if tiny and preset is None else [])
    return Prepared(name=model, config=config, auto=auto, multimodal=multimodal, reference_attention=attention,
                    tiny=shrunk, preset=preset, args=args, text_only=text_only)


def build(prepared: Prepared, dtype: torch.dtype, attn_implementation: str, seed: int = SEED) -> nn.Module:
    """The model with weights drawn from ``seed`` (in float32, then cast: every dtype holds the same weights; a
    vision-language model's image projection its init leaves at zero drawn too, :func:`~verify.model.multimodal.
    redraw_zero_init`), in training mode, every dropout off; in float64, the constants it makes at init in float32 remade in float64
    (:func:`~verify.model.precision.float64_decay_tables`)."""
    import copy

    config = copy.deepcopy(prepared.config)
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights in every process: an init through LAPACK (orthogonal) follows threads
    try:
        # eager experts: grouped_mm (the default where available) takes float32 / bfloat16 only
        model = prepared.model_class._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32,
                                                  experts_implementation="eager")
    except (ValueError, TypeError, KeyError, RuntimeError, AttributeError) as exc:
        if type(exc).__module__.startswith("blockdiag_dist"):  # a refusal of the attention it was built with
            raise
        raise ModelSpecError(f"--model {prepared.name}: expected {type(config).__name__} to build a model, got "
                             f"{type(exc).__name__}: {_first_line(exc)}") from exc
    finally:
        torch.set_num_threads(threads)
    if prepared.multimodal:  # images must reach the text: no image projection the init left at zero
        from .multimodal import redraw_zero_init

        redraw_zero_init(model, seed)
    model = model.to(dtype)
    from .precision import float64_decay_tables

    float64_decay_tables(model)  # constants a model makes at init in float32 (MiniMax's), remade in a float64 model
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model.train()


def config_summary(prepared: Prepared) -> dict[str, Any]:
    """A few fields that say what the (tiny) model is, for reports."""
    c = prepared.config
    text = getattr(c, "text_config", None) or c
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "sliding_window", "attention_chunk_size", "layer_types", "layers_block_type", "vocab_size")
    out = {k: v for k in keys if (v := _global_field(text, k)) is not None}
    if prepared.multimodal:
        v = c.vision_config
        out["vision"] = {k: x for k in ("depth", "hidden_size", "num_heads", "fullatt_block_indexes",
                                        "deepstack_visual_indexes") if (x := _global_field(v, k)) is not None}
    return out


def _global_field(config: Any, name: str) -> Any:
    """``config.name``, or None when it has none or when it varies per layer (transformers refuses the global
    read of a per-layer field, Gemma 4's ``head_dim``)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError, which is no AttributeError
        return None


def _dataclass_fields(config: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(type(config))] if dataclasses.is_dataclass(config) else list(vars(config))
