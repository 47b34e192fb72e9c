"""The trained weights in Hugging Face format, next to the checkpoints, for inference and
fine-tuning tools that know nothing of DeepSpeed or FSDP.

The export streams: the weights arrive one tensor at a time (`TrainEngine.full_state_dict`:
FSDP2 gathers each from every rank's shard, ZeRO-1 copies each from the GPU) and go into
safetensors files of at most `MAX_SHARD_BYTES` each, named as `save_pretrained` names them
(`model.safetensors` alone, else `model-00001-of-0000N.safetensors` and
`model.safetensors.index.json`). Rank 0's host holds the shard being filled and the tensor just
received, never the whole model (141 GB for a 70B model in bf16).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from slurm_autosp.config import LoraConfig
from slurm_autosp.data.prepared import stop_token_ids
from slurm_autosp.lifecycle.durable import rename_durably
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lora import adapter_state, is_adapter, merged_weights, save_adapter

log = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 * 10**9  # per safetensors file, as the Hugging Face Hub's models are cut
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

Weights = Iterable[tuple[str, torch.Tensor]]


def distinct_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict as `save_pretrained` writes it, in its order: a tensor tied to
    another (the output head to the input embedding) once, under the name `from_pretrained`
    ties the others to (not a key of the model's `all_tied_weights_keys`), and without its
    `_keys_to_ignore_on_save`. Sharded parameters stay DTensors: the caller gathers them."""
    state = model.state_dict(keep_vars=True)
    tie_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    names: dict[int, list[str]] = {}
    for name, tensor in state.items():
        names.setdefault(id(tensor), []).append(name)
    kept = {next((n for n in group if n not in tie_targets), group[0]) for group in names.values()}
    for name, tensor in state.items():
        if name in kept and name not in ignored:
            yield name, tensor


def every_name(name: str) -> bool:
    return True


def exported_names(lora: LoraConfig | None) -> Callable[[str], bool]:
    """The weights the end of a run exports: all of them, but only the adapters of a LoRA run
    that exports no merged model (the base is already on disk: gathering it would cost a
    70B model's 140 GB of transfers for nothing)."""
    return is_adapter if lora is not None and not lora.export_merged else every_name


def whole_weights(
    model: nn.Module, keep: Callable[[str], bool] = every_name
) -> Iterator[tuple[str, torch.Tensor]]:
    """A model that holds its weights whole (ZeRO-1, or no engine), those `keep` keeps copied
    to the host one tensor at a time as they are taken."""
    for name, tensor in distinct_tensors(model):
        if keep(name):
            yield name, tensor.detach().cpu()


class ShardWriter:
    """Tensors, as they arrive, into safetensors files of at most `max_bytes` (a bigger tensor
    alone in its own): the shard being filled is written out before a tensor that would
    overflow it joins, so what is held is one shard and the tensor just received."""

    def __init__(self, model: PreTrainedModel, directory: Path, max_bytes: int):
        self.model, self.directory, self.max_bytes = model, directory, max_bytes
        self.held: dict[str, torch.Tensor] = {}
        self.held_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []  # each shard's file and its tensors
        self.total_bytes = 0
        self.parameters = 0
        self.dtype: torch.dtype | None = None  # of the floating-point weights written

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.held and self.held_bytes + size > self.max_bytes:
            self._write_shard()
        self.held[name] = tensor.contiguous()
        self.held_bytes += size
        self.total_bytes += size
        self.parameters += tensor.numel()
        if tensor.is_floating_point():
            self.dtype = self.dtype or tensor.dtype

    def _write_shard(self) -> None:
        # what save_pretrained writes: the checkpoint's layout where loading converted it
        # (e.g. experts fused at load); tensors are not split, so a shard converts alone
        shard = revert_weight_conversion(self.model, self.held)
        path = self.directory / f".shard-{len(self.written) + 1:05d}"
        save_file(shard, path, metadata={"format": "pt"})
        self.written.append((path, list(shard)))
        self.held, self.held_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, name the files as save_pretrained does (and its index when
        there are several); the files written."""
        if self.held or not self.written:
            self._write_shard()
        count = len(self.written)
        names = [
            WEIGHTS if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
            for i in range(1, count + 1)
        ]
        weight_map = {}
        for (path, tensors), name in zip(self.written, names, strict=True):
            os.rename(path, self.directory / name)
            weight_map.update(dict.fromkeys(tensors, name))
        if count > 1:
            index = {
                "metadata": {"total_parameters": self.parameters, "total_size": self.total_bytes},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (self.directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names


def export_run(
    model: nn.Module,
    run_dir: Path,
    weights: Weights,
    tokenizer_dir: Path | None,
    lora: LoraConfig | None,
    base: str | None,
) -> None:
    """Rank 0 calls this at the end of training: the whole model to `hf/`; a LoRA run's
    adapters to `adapter/` (PEFT's format, `base` recorded as their base) and, with
    `model.lora.export_merged`, the base with the adapters merged in to `hf/`. Takes every
    tensor of `weights`, as `export_hf` does, and writes the adapters even when the merged
    model fails (a full disk)."""
    if lora is None:
        export_hf(model, run_dir, weights, tokenizer_dir)
        return
    adapters: dict[str, torch.Tensor] = {}

    def kept(stream: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            if is_adapter(name):
                adapters[name] = tensor
            yield name, tensor

    stream = kept(weights)
    try:
        if lora.export_merged:
            export_hf(model, run_dir, merged_weights(stream, lora), tokenizer_dir)
    finally:  # the adapters are the run's result, whatever became of the merged model
        _take_all(stream)
        _export_adapters(run_dir, lora, base, adapters, tokenizer_dir)


def _export_adapters(
    run_dir: Path,
    lora: LoraConfig,
    base: str | None,
    adapters: dict[str, torch.Tensor],
    tokenizer_dir: Path | None,
) -> None:
    def write(directory: Path) -> None:
        save_adapter(directory, lora, base, adapter_state(adapters.items()))
        _copy_tokenizer(tokenizer_dir, directory)

    run = RunDir(run_dir)
    _swap_in(run.adapter_export, run.adapter_export_partial, run.adapter_export_previous, write)
    log.info(
        "exported the LoRA adapters to %s (PEFT: PeftModel.from_pretrained)", run.adapter_export
    )


def export_hf(
    model: nn.Module,
    run_dir: Path,
    weights: Weights | None = None,
    tokenizer_dir: Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Rank 0 calls this. `weights`: the whole model's tensors, one at a time
    (`TrainEngine.full_state_dict`); None: the model's own, which it holds whole. Every tensor
    of `weights` is taken, even when nothing is exported or the export fails: under FSDP2 the
    other ranks gather each one with rank 0. The files of `tokenizer_dir` (the prepared data's
    tokenizer) go beside the weights, so the export loads with AutoTokenizer as well as
    AutoModelForCausalLM, and generation stops where the data's turns (or documents) end."""
    if not isinstance(model, PreTrainedModel):
        log.info("model %s is not a Hugging Face model: no export", type(model).__name__)
        _take_all(weights)
        return
    stream = iter(whole_weights(model) if weights is None else weights)
    try:
        _export(model, RunDir(run_dir), stream, tokenizer_dir, max_shard_bytes)
    finally:
        _take_all(stream)


def _take_all(weights: Weights | None) -> None:
    for _ in weights or ():
        pass


def _export(
    model: PreTrainedModel,
    run: RunDir,
    weights: Iterator[tuple[str, torch.Tensor]],
    tokenizer_dir: Path | None,
    max_shard_bytes: int,
) -> None:
    files: list[str] = []

    def write(directory: Path) -> None:
        writer = ShardWriter(model, directory, max_shard_bytes)
        for name, tensor in weights:
            writer.add(name, tensor)
        files.extend(writer.finish())
        _write_configs(model, directory, writer.dtype)
        _copy_tokenizer(tokenizer_dir, directory)

    _swap_in(run.hf_export, run.hf_export_partial, run.hf_export_previous, write)
    log.info(
        "exported Hugging Face weights to %s (%d file%s)",
        run.hf_export,
        len(files),
        "s"[: len(files) > 1],
    )


def _swap_in(target: Path, partial: Path, previous: Path, write: Callable[[Path], None]) -> None:
    """`write` fills `partial`, which then replaces `target` (the old one briefly `previous`):
    a killed export leaves the old one or the new one at `target`, never half of one."""
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write(partial)
    _readable_like_the_rest(partial)
    if target.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(target, previous)
    rename_durably(partial, target)
    shutil.rmtree(previous, ignore_errors=True)


def _copy_tokenizer(tokenizer_dir: Path | None, export: Path) -> None:
    if tokenizer_dir is not None:
        for path in sorted(tokenizer_dir.iterdir()):
            shutil.copyfile(path, export / path.name)
        _stop_where_turns_end(export, tokenizer_dir)


def _write_configs(model: PreTrainedModel, export: Path, dtype: torch.dtype | None) -> None:
    """config.json as save_pretrained writes it: the weights' dtype, and the architecture by
    the model's class (FSDP2's wrapper class less its prefix); generation_config.json for a
    model that can generate. The live model's config is left as it is."""
    config = copy.deepcopy(model.config)
    if dtype is not None:
        config.dtype = dtype
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(export)
    if model.can_generate():
        model.generation_config.save_pretrained(export)


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
