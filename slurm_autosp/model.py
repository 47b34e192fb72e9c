"""The model, built the way the user already builds it: an HF class, a local checkpoint, or
their own constructor."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from slurm_autosp.config import ConfigError, ModelConfig


def build_model(cfg: ModelConfig) -> nn.Module:
    """An fp32 causal LM; precision is the engine's business, not the model's."""
    if cfg.builder:
        return _call_builder(cfg)
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.pretrained_path:
        return AutoModelForCausalLM.from_pretrained(
            cfg.pretrained_path, attn_implementation=cfg.attn_implementation, dtype=torch.float32
        )
    try:
        hf_config = AutoConfig.for_model(cfg.model_type, **cfg.hf_fields())
    except ValueError as err:
        raise ConfigError(f"model.model_type={cfg.model_type!r}: {err}") from err
    hf_config.use_cache = False
    return AutoModelForCausalLM.from_config(
        hf_config, attn_implementation=cfg.attn_implementation, dtype=torch.float32
    )


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
        raise ConfigError(f"model.builder={cfg.builder!r} returned {type(model).__name__}, not an nn.Module")
    return model
