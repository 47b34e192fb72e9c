"""The model, built the way the user already builds it: an HF class, a local checkpoint, or
their own constructor."""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn

from slurm_autosp.config import (
    ConfigError,
    ModelConfig,
    Precision,
)
from slurm_autosp.lora import add_adapters

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def compute_dtype(precision: Precision) -> torch.dtype:
    """The dtype the model's weights and activations are in for `train.precision`."""
    return torch.bfloat16 if precision is Precision.bf16 else torch.float32


def build_model(
    cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> nn.Module:
    """The causal LM in `dtype`, built (or read) straight onto `device` (default: the host).
    An engine that holds the whole model on its GPU asks for it there in its training dtype:
    an fp32 copy on every rank's host first (Llama-8B: 32 GB a rank) would be spent for nothing.
    A `model.builder` model is the builder's, as it returns it. With `model.lora`, the model
    has its adapters (lora.py)."""
    model = _build_base(cfg, dtype, device or torch.device("cpu"))
    return add_adapters(model, cfg.lora) if cfg.lora else model


def _build_base(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    if cfg.builder:
        return _call_builder(cfg)
    from transformers import AutoModelForCausalLM

    if cfg.pretrained_path:
        return AutoModelForCausalLM.from_pretrained(
            cfg.pretrained_path,
            attn_implementation=cfg.attn_implementation,
            dtype=dtype,
            device_map=None if device.type == "cpu" else device,
        )
    with device:
        return AutoModelForCausalLM.from_config(
            hf_config(cfg), attn_implementation=cfg.attn_implementation, dtype=dtype
        )


def build_skeleton(cfg: ModelConfig) -> nn.Module:
    """The HF model's architecture on the meta device, nothing allocated: parameter sharding
    allocates only each rank's shards. A pretrained model's architecture comes from its
    checkpoint's config; its weights are loaded separately."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            hf_config(cfg), attn_implementation=cfg.attn_implementation, dtype=torch.float32
        )
        return add_adapters(model, cfg.lora) if cfg.lora else model


def hf_config(cfg: ModelConfig):
    """The HF config the model is built from: its checkpoint's, or the job config's fields."""
    from transformers import AutoConfig

    if cfg.pretrained_path and not os.path.isfile(os.path.join(cfg.pretrained_path, "config.json")):
        raise ConfigError(
            f"model.pretrained_path={cfg.pretrained_path}: no config.json there, so it is not a Hugging Face "
            "checkpoint; point it at a directory written by save_pretrained (config.json and the weights)"
        )
    try:
        if cfg.pretrained_path:
            config = AutoConfig.from_pretrained(cfg.pretrained_path)
        else:
            config = AutoConfig.for_model(cfg.model_type, **cfg.hf_fields())
    except (OSError, ValueError, NotImplementedError, StrictDataclassError) as err:  # its checks
        where = (
            f"model.pretrained_path={cfg.pretrained_path}"
            if cfg.pretrained_path
            else f"model.model_type={cfg.model_type!r}"
        )
        raise ConfigError(f"{where}: {err}") from err
    config.use_cache = False
    return config


def model_vocab_size(cfg: ModelConfig) -> int | None:
    """The vocabulary of the model trained: a pretrained checkpoint's own, else the config's."""
    return cfg.vocab_size if cfg.builder else hf_config(cfg).vocab_size


def hf_model_class(config: Any) -> type[PreTrainedModel]:
    from transformers import AutoModelForCausalLM, PreTrainedModel

    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    assert isinstance(model_class, type) and issubclass(model_class, PreTrainedModel)
    return model_class


def hf_decoder_layer_class(config: Any) -> type:
    """The repeated block of an HF causal LM family (the first module its `_no_split_modules` names)."""
    model_class = hf_model_class(config)
    names = model_class._no_split_modules
    assert isinstance(names, list) and names, (
        f"{model_class.__name__} has no _no_split_modules list"
    )
    return getattr(sys.modules[model_class.__module__], names[0])


def _call_builder(cfg: ModelConfig) -> nn.Module:
    assert cfg.builder is not None
    module_name, _, func_name = cfg.builder.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"model.builder={cfg.builder!r}: cannot import it ({err}); the module must be "
            "importable on every node (installed, or on PYTHONPATH)"
        ) from err
    model = func(cfg)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.builder={cfg.builder!r} returned {type(model).__name__}, not an nn.Module"
        )
    return model
