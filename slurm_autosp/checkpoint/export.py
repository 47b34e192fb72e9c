"""The trained weights in Hugging Face format, next to the checkpoints, for inference and
fine-tuning tools that know nothing of DeepSpeed."""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

log = logging.getLogger(__name__)


def hf_export_dir(run_dir: Path) -> Path:
    return run_dir / "hf"


def export_hf(model: nn.Module, run_dir: Path) -> None:
    """Under ZeRO-1 every rank holds the full weights; rank 0 calls this."""
    if not hasattr(model, "save_pretrained"):
        log.info("model %s has no save_pretrained: no Hugging Face export", type(model).__name__)
        return
    target = hf_export_dir(run_dir)
    model.save_pretrained(target, safe_serialization=True)
    log.info("exported Hugging Face weights to %s", target)
