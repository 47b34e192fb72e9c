"""The trained weights in Hugging Face format, next to the checkpoints, for inference and
fine-tuning tools that know nothing of DeepSpeed or FSDP."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)


def hf_export_dir(run_dir: Path) -> Path:
    return run_dir / "hf"


def export_hf(
    model: nn.Module,
    run_dir: Path,
    weights: dict[str, torch.Tensor] | None = None,
    tokenizer_dir: Path | None = None,
) -> None:
    """Rank 0 calls this. `weights`: the gathered full state dict when the model holds only
    shards (parameter sharding); None when it holds the whole model (ZeRO-1). The files of
    `tokenizer_dir` (the prepared data's tokenizer) go beside the weights, so the export loads
    with AutoTokenizer as well as AutoModelForCausalLM."""
    save_pretrained = getattr(model, "save_pretrained", None)
    if save_pretrained is None:
        log.info("model %s has no save_pretrained: no Hugging Face export", type(model).__name__)
        return
    target = hf_export_dir(run_dir)
    partial, previous = target.with_name(".hf.partial"), target.with_name(".hf.previous")
    shutil.rmtree(partial, ignore_errors=True)
    save_pretrained(partial, safe_serialization=True, state_dict=weights)
    if tokenizer_dir is not None:
        for path in sorted(tokenizer_dir.iterdir()):
            shutil.copyfile(path, partial / path.name)
    if (
        target.exists()
    ):  # a killed export leaves the old model or the new one in hf/, never half of one
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(target, previous)
    os.rename(partial, target)
    shutil.rmtree(previous, ignore_errors=True)
    log.info("exported Hugging Face weights to %s", target)
