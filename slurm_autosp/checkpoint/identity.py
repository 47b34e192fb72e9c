"""Whether a job resuming a checkpoint continues the run that wrote it.

Every checkpoint records the config it was written with, resolved and flat (`run_settings`:
key -> JSON value). A job may resume it only while the keys that make the run what it is
(`is_identity`) are unchanged: the model, the data (its paths, and what the files there hold:
data prepared again at the same path is other data) and the position in it, the seed, the
global batch, the precision and the engine whose format its state is in. Other keys may change
between submissions and the resumed job names them: steps, the learning-rate schedule,
checkpoint cadence, traces, the cluster's time limit, and the world size and SP x DP layout
with the micro-batch and gradient accumulation that keep the global batch: the engines'
checkpoints reshard, and only a model with dropout is refused another layout (store.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from torch import nn

from slurm_autosp.cluster.layout import ParallelLayout
from slurm_autosp.config import JobConfig
from slurm_autosp.data import data_identity
from slurm_autosp.lora import base_fingerprint

IDENTITY_PREFIXES = ("model.", "data.blend")
IDENTITY_KEYS = frozenset(
    {
        "data.source",
        "data.path",
        "data.seq_len",
        "data.shuffle",
        "data.documents",
        "data.contents",
        "data.tokenizer",
        "train.seed",
        "train.global_batch",
        "train.precision",
        "parallel.zero_stage",
    }
)
# what the global batch is made of: each may change while it stays, and is named beside it when not
BATCH_KEYS = ("train.micro_batch", "train.grad_accum", "cluster.world_size", "parallel.sp_size")
# keys no config sets directly, and what sets them
DERIVED = {
    "train.global_batch": "train.micro_batch x train.grad_accum x data-parallel ranks",
    "cluster.world_size": "cluster.nodes x ranks per node",
    "data.contents": "the files at data.path or data.blend: prepared again since?",
    "data.tokenizer": "the tokenizer data.path or data.blend was prepared with",
    "model.base": "the weights at model.pretrained_path that LoRA adapts: another checkpoint there?",
}


def run_settings(cfg: JobConfig, layout: ParallelLayout, zero_stage: int) -> dict[str, Any]:
    """The config as this job runs it, flat and JSON-serialisable, with the values it resolves
    or derives (ZeRO stage, precision, global batch, world size, layout, the data's contents and
    tokenizer): what a checkpoint's engine state and data position depend on."""
    tree = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    assert isinstance(tree, dict)
    return {
        **dict(_flatten(tree)),
        **data_identity(cfg.data),
        "parallel.zero_stage": zero_stage,
        "train.precision": cfg.precision.value,
        "train.global_batch": cfg.global_batch,
        "cluster.world_size": cfg.cluster.world_size,
        "parallel.layout": repr(layout),
        **_lora_base(cfg),
    }


def _lora_base(cfg: JobConfig) -> dict[str, str]:
    """A LoRA run's checkpoints hold no base: the one every start reads must be the same."""
    if cfg.model.lora is None or not cfg.model.pretrained_path:
        return {}
    return {"model.base": base_fingerprint(cfg.model.pretrained_path)}


def _flatten(tree: dict[Any, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def is_identity(key: str) -> bool:
    return key in IDENTITY_KEYS or key.startswith(IDENTITY_PREFIXES)


@dataclass(frozen=True)
class Difference:
    key: str
    saved: Any  # in the checkpoint
    current: Any  # in this job's config

    def __str__(self) -> str:
        return f"{self.key} {_text(self.saved)} -> {_text(self.current)}"


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[Difference]:
    """Every key whose value differs, by key; a key one side lacks (a config field added or
    removed since, an `extra` entry) counts as null there."""
    keys = sorted(saved.keys() | current.keys())
    return [
        Difference(k, saved.get(k), current.get(k)) for k in keys if saved.get(k) != current.get(k)
    ]


def refused(
    saved: dict[str, Any], current: dict[str, Any]
) -> tuple[list[Difference], list[Difference]]:
    """(the identity keys that differ, every key that differs) between a checkpoint's settings
    and a job's; with the global batch, the keys of BATCH_KEYS that changed it. A derived key
    the checkpoint does not record is not compared: the checkpoint predates its recording."""
    changed = differences(saved, current)
    recorded = [d for d in changed if d.key in saved or d.key not in DERIVED]
    identity = [d for d in recorded if is_identity(d.key)]
    if any(d.key == "train.global_batch" for d in identity):
        identity = sorted(
            [*identity, *(d for d in recorded if d.key in BATCH_KEYS)], key=lambda d: d.key
        )
    return identity, changed


DROPOUT_MODULES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def dropout_of(model: nn.Module) -> list[str]:
    """Where `model` draws random numbers in training, named: its config's dropout fields above
    0 (Hugging Face's attention_dropout, hidden_dropout, resid_pdrop, ...) and its dropout modules
    with p above 0. Empty for the default Llama."""
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    fields: dict[str, Any] = to_dict() if callable(to_dict) else {}
    found = [
        f"{key}={value}"
        for key, value in sorted(fields.items())
        if ("dropout" in key or "pdrop" in key)
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and value > 0
    ]
    modules = [
        name for name, m in model.named_modules() if isinstance(m, DROPOUT_MODULES) and m.p > 0
    ]
    if modules:
        found.append(f"{len(modules)} dropout modules, the first {modules[0]}")
    return found


def refusal(checkpoint: Path, refused: list[Difference], run_name: str) -> str:
    """Why `checkpoint` cannot be resumed: each identity key that differs, and both ways out."""
    lines = [
        f"checkpoint {checkpoint} belongs to a different run than this job's config describes:"
    ]
    for d in refused:
        derived = f" (set by {DERIVED[d.key]})" if d.key in DERIVED else ""
        lines.append(
            f"  {d.key}: {_text(d.saved)} in the checkpoint, {_text(d.current)} now{derived}"
        )
    restore = " ".join(f"{d.key}={_text(d.saved)}" for d in refused if d.key not in DERIVED)
    lines.append(
        f"resume it with the values it was written with{f' ({restore})' if restore else ''}, or start a new "
        f"run with another run.name (this job's is run.name={run_name})"
    )
    return "\n".join(lines)


def _text(value: Any) -> str:
    """A value as it is written on the command line (key=value)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
