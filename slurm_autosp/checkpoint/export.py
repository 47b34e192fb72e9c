"""The trained weights in Hugging Face format, next to the checkpoints, for inference and
fine-tuning tools that know nothing of DeepSpeed or FSDP."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, Optional

import torch
from torch import nn

log = logging.getLogger(__name__)


def hf_export_dir(run_dir: Path) -> Path:
    return run_dir / "hf"


def export_hf(model: nn.Module, run_dir: Path, weights: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Rank 0 calls this. `weights`: the gathered full state dict when the model holds only
    shards (parameter sharding); None when it holds the whole model (ZeRO-1)."""
    if not hasattr(model, "save_pretrained"):
        log.info("model %s has no save_pretrained: no Hugging Face export", type(model).__name__)
        return
    target = hf_export_dir(run_dir)
    model.save_pretrained(target, safe_serialization=True, state_dict=weights)
    log.info("exported Hugging Face weights to %s", target)
