"""The trained weights in Hugging Face format, next to the checkpoints, for inference and
fine-tuning tools that know nothing of DeepSpeed or FSDP."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import torch
from torch import nn

from slurm_autosp.data.prepared import stop_token_ids
from slurm_autosp.lifecycle.run_dir import RunDir

log = logging.getLogger(__name__)


def export_hf(
    model: nn.Module,
    run_dir: Path,
    weights: dict[str, torch.Tensor] | None = None,
    tokenizer_dir: Path | None = None,
) -> None:
    """Rank 0 calls this. `weights`: the gathered full state dict when the model holds only
    shards (parameter sharding); None when it holds the whole model (ZeRO-1). The files of
    `tokenizer_dir` (the prepared data's tokenizer) go beside the weights, so the export loads
    with AutoTokenizer as well as AutoModelForCausalLM, and generation stops where the data's
    turns (or documents) end."""
    save_pretrained = getattr(model, "save_pretrained", None)
    if save_pretrained is None:
        log.info("model %s has no save_pretrained: no Hugging Face export", type(model).__name__)
        return
    run = RunDir(run_dir)
    target, partial, previous = run.hf_export, run.hf_export_partial, run.hf_export_previous
    shutil.rmtree(partial, ignore_errors=True)
    save_pretrained(partial, safe_serialization=True, state_dict=weights)
    if tokenizer_dir is not None:
        for path in sorted(tokenizer_dir.iterdir()):
            shutil.copyfile(path, partial / path.name)
        _stop_where_turns_end(partial, tokenizer_dir)
    _readable_like_the_rest(partial)
    if (
        target.exists()
    ):  # a killed export leaves the old model or the new one in hf/, never half of one
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(target, previous)
    os.rename(partial, target)
    shutil.rmtree(previous, ignore_errors=True)
    log.info("exported Hugging Face weights to %s", target)


def _stop_where_turns_end(export: Path, tokenizer_dir: Path) -> None:
    """config.json's eos_token_id becomes the data's end-of-turn token and generation stops at
    it or at EOS: the model's default EOS may never occur in the data it was trained on."""
    try:
        stop = stop_token_ids(tokenizer_dir)
    except (ValueError, KeyError) as err:
        log.warning("%s: no end-of-turn token recorded (%s); eos_token_id left as is", tokenizer_dir, err)  # fmt: skip
        return
    for name, value in (("config.json", stop[0]), ("generation_config.json", stop)):
        path = export / name
        if path.exists():  # generation_config.json: only for a model that can generate
            config = json.loads(path.read_text())
            config["eos_token_id"] = value
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _readable_like_the_rest(export: Path) -> None:
    """safetensors writes the weights through a temporary file (mode 0600) renamed into place;
    every file gets the mode a new file gets here (0666 less the umask), as the others have."""
    probe = export / ".mode"
    probe.touch()
    mode = stat.S_IMODE(probe.stat().st_mode)
    probe.unlink()
    for path in export.rglob("*"):
        if path.is_file():
            path.chmod(mode)
