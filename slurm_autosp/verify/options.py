"""verify's options (the `verify.*` keys) and the shrunk copy of the configured model."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slurm_autosp.config import ConfigError, ModelConfig
from slurm_autosp.model import hf_config


class Inject(str, enum.Enum):
    none = "none"
    per_shard_shift = "per_shard_shift"


@dataclass
class VerifyOptions:
    """The `verify.*` keys: the size of the check, not of the job."""

    dp: int = 1
    layers: int = 2
    head_dim: int = 8
    vocab_size: int = 256
    seq_len: int = 0  # 0: 32 * sp_size - 3
    rows: int = 2
    documents: int = 0  # documents packed per row (verify.documents); 0: one sequence per row
    window: int = 0  # the shrunk copy's sliding window where the model has one; 0: the model's
    tolerance: float = 1e-5
    seed: int = 0
    inject: Inject = Inject.none
    # false: the SP step's graphs run through AOTAutograd without inductor's code generation:
    # the rewrite checked in seconds, inductor's kernels not (the family battery's setting)
    codegen: bool = True


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate job-config arguments from `verify.*` ones (`--dp N` is `verify.dp=N`)."""
    job, verify = [], []
    args = iter(argv)
    for arg in args:
        if arg == "--dp":
            value = next(args, None)
            if value is None:
                raise ConfigError("--dp needs a number of data-parallel replicas, e.g. --dp 2")
            verify.append(f"dp={value}")
        elif arg.startswith("--dp="):
            verify.append(f"dp={arg[len('--dp=') :]}")
        elif arg.startswith("verify."):
            verify.append(arg[len("verify.") :])
        else:
            job.append(arg)
    return job, verify


def load_options(overrides: list[str]) -> VerifyOptions:
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(VerifyOptions), OmegaConf.from_dotlist(overrides)
        )
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        known = ", ".join(f.name for f in dataclasses.fields(VerifyOptions))
        raise ConfigError(
            f"verify.{key}: {str(err).splitlines()[0]} Known verify keys: {known}"
        ) from err
    options = OmegaConf.to_object(merged)
    assert isinstance(options, VerifyOptions)
    for key in ("dp", "layers", "head_dim", "vocab_size", "rows"):
        if getattr(options, key) < 1:
            raise ConfigError(f"verify.{key}={getattr(options, key)} must be >= 1")
    if options.head_dim % 2:
        raise ConfigError(
            f"verify.head_dim={options.head_dim} must be even (rotary embeddings pair dimensions)"
        )
    if options.seq_len < 0:
        raise ConfigError(f"verify.seq_len={options.seq_len} must be >= 0 (0 picks one)")
    if options.window < 0:
        raise ConfigError(f"verify.window={options.window} must be >= 0 (0: the model's own)")
    if options.documents < 0:
        raise ConfigError(
            f"verify.documents={options.documents} must be >= 0 (0: one sequence per row)"
        )
    return options


def _hf_config_of(model: ModelConfig) -> dict[str, Any]:
    """The model's HF config fields: from its local checkpoint, or from the job config."""
    if not model.pretrained_path:
        return {"model_type": model.model_type, **model.hf_fields()}
    loaded = hf_config(model).to_dict()
    keep_out = {
        "architectures",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "_name_or_path",
        "auto_map",
    }
    return {key: value for key, value in loaded.items() if key not in keep_out}


SPECIAL_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def special_ids_within(model: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """The model's pad/bos/eos ids (its own or its HF class's defaults, e.g. Phi-3's pad 32000)
    that fall outside the shrunk vocabulary, mapped to its last id: they would not embed."""
    config = hf_config(model)
    moved: dict[str, Any] = {}
    for key in SPECIAL_TOKEN_IDS:
        value = getattr(config, key, None)
        ids = value if isinstance(value, list) else [value]
        if any(i is not None and i >= vocab_size for i in ids):
            within = [i if i is None else min(i, vocab_size - 1) for i in ids]
            moved[key] = within if isinstance(value, list) else within[0]
    return moved


def _latent_attention_within(model: ModelConfig, head_dim: int, hidden: int) -> dict[str, Any]:
    """Multi-head latent attention (DeepSeek-V2/V3 and their kin) takes its rotary head_dim
    from `qk_rope_head_dim` and projects keys and values from latent ranks: the shrunk copy's
    head parts are `head_dim` each and its ranks the shrunk hidden size, or its rotary
    embedding (head_dim) would not match its queries' rotary part."""
    config = hf_config(model)
    if getattr(config, "kv_lora_rank", None) is None:
        return {}
    return {
        "qk_rope_head_dim": head_dim,
        "qk_nope_head_dim": head_dim,
        "v_head_dim": head_dim,
        "kv_lora_rank": hidden,
        "q_lora_rank": hidden if getattr(config, "q_lora_rank", None) else None,
    }


def _dropout_off(model: ModelConfig) -> dict[str, float]:
    """Every dropout probability and router jitter of the model's config (attention_dropout,
    resid_pdrop, router_jitter_noise, ...), set to 0: each rank draws its own random numbers, so
    with them on no SP step equals one device's even when the architecture is computed exactly,
    which is what verify checks."""
    return {
        key: 0.0
        for key, value in hf_config(model).to_dict().items()
        if any(word in key for word in ("dropout", "pdrop", "jitter"))
        and isinstance(value, float)
        and value > 0
    }


def shrink_model_config(model: ModelConfig, options: VerifyOptions) -> ModelConfig:
    """A CPU-sized copy of `model` with the same head layout, class and RoPE settings.

    A model from `builder` gets the shrunk fields and must honour them; a `pretrained_path`
    model is rebuilt from its config with random weights (equivalence is a property of the
    architecture, not of the weights). LoRA adapters stay, without dropout.
    """
    fields = _hf_config_of(model)
    heads = fields.get("num_attention_heads")
    if not heads:
        raise ConfigError(
            "model.num_attention_heads is needed to shrink the model with the same head layout"
        )
    kv_heads = fields.get("num_key_value_heads") or heads
    hidden = heads * options.head_dim
    shrunk = {
        "vocab_size": min(fields.get("vocab_size") or options.vocab_size, options.vocab_size),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": min(fields.get("num_hidden_layers") or options.layers, options.layers),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": options.head_dim,
    }
    typed = {f.name for f in dataclasses.fields(ModelConfig)}
    extra = {k: v for k, v in fields.items() if k not in typed and k not in shrunk}
    extra.update({k: v for k, v in model.extra.items() if k not in shrunk})
    extra.update(_latent_attention_within(model, options.head_dim, hidden))
    extra.update(_dropout_off(model))
    extra.update(special_ids_within(model, shrunk["vocab_size"]))
    if options.window and extra.get("sliding_window"):
        extra["sliding_window"] = options.window
    kept = {k: v for k, v in fields.items() if k in typed and k not in shrunk and k != "extra"}
    kept.pop("model_type", None)
    return dataclasses.replace(
        model,
        **kept,
        **shrunk,
        model_type=fields.get("model_type") or model.model_type,
        pretrained_path=None,
        extra=extra,
        lora=model.lora and dataclasses.replace(model.lora, dropout=0.0),
    )


def verify_seq_len(sp_size: int, options: VerifyOptions) -> int:
    return options.seq_len or 32 * sp_size - 3
