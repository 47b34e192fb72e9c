"""ZeRO-1's checkpoint in a format that records no world size or SP x DP layout, so a run
resumes on another one.

DeepSpeed's own checkpoint keeps each rank's flat slice of the fp32 master weights and Adam's
moments as it is, cut where that world size cuts the flattened model: it loads on as many ranks
only. Here each slice is cut back into the parameters it covers, by name:

    module.pt            rank 0: the module's weights and buffers (every rank holds them whole),
                         less a LoRA model's base, which every start reads from its checkpoint
    fragments/rank_N.pt  rank N's flat partitions as they are: the fp32 master weights and each
                         optimizer state tensor (Adam's exp_avg, exp_avg_sq), one per param group
    fragments.json       rank 0: which rank's file holds which range of which flattened parameter,
                         and where in its flat partitions
    optimizer.pt         rank 0: the optimizer's scalar state (Adam's step) and param groups
    schedule.pt          rank 0: the LR schedule

On load every rank fills its own partition from the saved pieces that overlap it, opening only
their files and, mapped (mmap), reading only their bytes; the module's trained weights then
follow from the masters as after every step (cast to the module's dtype and all-gathered), and
its buffers and frozen weights come from module.pt. Resident or offloaded, fp32 or bf16
(DeepSpeed's BF16_Optimizer), the pieces are the same, so those may differ between save and load.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from slurm_autosp.checkpoint.state_files import StateFiles
from slurm_autosp.checkpoint.store import CheckpointError
from slurm_autosp.lora import base_weights

if TYPE_CHECKING:
    from slurm_autosp.compat.deepspeed_api import Fragment, ZeroPartition

MODULE_FILE = "module.pt"
FRAGMENTS_DIR = "fragments"
INDEX_FILE = "fragments.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULE_FILE = "schedule.pt"
MASTER = "master"  # a piece's fp32 master weights, beside its optimizer state tensors


def state_files(
    module: nn.Module,
    partition: ZeroPartition,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> StateFiles:
    """Collective: every rank's pieces, rank 0's also the rest and the index, as files to
    write. Each flat partition is there whole, as its own tensor: no copy, however large."""
    rank = dist.get_rank()
    optimizer, flats = partition.optimizer, partition.flat_partitions()
    keys = _state_keys(optimizer, flats)
    files = StateFiles()
    files.trees[_rank_file(rank)] = {
        MASTER: flats,
        **{key: [optimizer.state[f][key] for f in flats] for key in keys},
    }
    held = [
        (name, fragment.start, fragment.numel, fragment.group, fragment.offset)
        for name, fragment in _fragments(module, partition)
    ]
    every: list[list[tuple[str, int, int, int, int]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, held)
    if rank != 0:
        return files
    base = base_weights(module)
    files.trees[MODULE_FILE] = {k: v for k, v in module.state_dict().items() if k not in base}
    state = optimizer.state_dict()
    scalars = {i: {k: v for k, v in s.items() if k not in keys} for i, s in state["state"].items()}
    files.trees[OPTIMIZER_FILE] = {"state": scalars, "param_groups": state["param_groups"]}
    files.trees[SCHEDULE_FILE] = scheduler.state_dict()
    parameters: dict[str, list[tuple[int, ...]]] = {}
    for saved_by, ranges in enumerate(every):
        for name, *where in ranges:
            parameters.setdefault(name, []).append((saved_by, *where))
    files.texts[INDEX_FILE] = json.dumps(
        {"ranks": len(every), "state": keys, "parameters": parameters}
    )
    return files


def load(
    path: Path,
    module: nn.Module,
    partition: ZeroPartition,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Collective: restore what `save` wrote, on any number of ranks, into a freshly built
    engine (the optimizer's state is created here, as its first step would)."""
    index = json.loads((path / INDEX_FILE).read_text())
    optimizer, flats = partition.optimizer, partition.flat_partitions()
    states = [{key: torch.zeros_like(flat) for key in index["state"]} for flat in flats]
    files: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    with torch.no_grad():
        for name, fragment in _fragments(module, partition):
            targets = {MASTER: flats[fragment.group], **states[fragment.group]}
            filled = 0
            for saved_by, start, numel, *at in index["parameters"].get(name, []):
                first = max(start, fragment.start)
                count = min(start + numel, fragment.start + fragment.numel) - first
                if count <= 0:
                    continue
                if saved_by not in files:
                    files[saved_by] = torch.load(
                        path / _rank_file(saved_by),
                        mmap=True,
                        weights_only=True,
                        map_location="cpu",
                    )
                saved = files[saved_by]
                for key, target in targets.items():
                    # at: (group, offset) in the saved flat partitions; absent in checkpoints
                    # written before, which hold each piece as a tensor of its own
                    source, base = (saved[key][at[0]], at[1]) if at else (saved[name][key], 0)
                    target.narrow(0, fragment.offset + first - fragment.start, count).copy_(
                        source.narrow(0, base + first - start, count)
                    )
                filled += count
            if filled != fragment.numel:
                raise CheckpointError(
                    f"checkpoint {path} holds {filled} of the {fragment.numel} elements of {name} "
                    f"(from {fragment.start} of the flattened parameter) this rank's optimizer "
                    "partition needs: it was written for another model"
                )
    # on the host, whatever device a checkpoint of an older version recorded (a fused AdamW's
    # step lives on its GPU): load_state_dict moves the state to its parameter's device
    saved = torch.load(path / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
    optimizer.load_state_dict(
        {
            "state": {i: {**saved["state"].get(i, {}), **s} for i, s in enumerate(states) if s},
            "param_groups": saved["param_groups"],
        }
    )
    partition.update_lp_params()
    _load_untrained(module, path / MODULE_FILE)
    scheduler.load_state_dict(
        torch.load(path / SCHEDULE_FILE, weights_only=True, map_location="cpu")
    )


def is_saved(path: Path) -> bool:
    """Whether `path` holds this format (not DeepSpeed's own, written before it)."""
    return (path / INDEX_FILE).is_file()


def _state_keys(optimizer: torch.optim.Optimizer, flats: list[torch.Tensor]) -> list[str]:
    """The optimizer's state tensors shaped like its flat partitions (none before its first
    step); scalar state (Adam's step) is the same on every rank."""
    state = optimizer.state.get(flats[0], {})
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == flats[0].shape)


def _fragments(module: nn.Module, partition: ZeroPartition) -> Iterator[tuple[str, Fragment]]:
    for name, param in module.named_parameters():
        fragment = partition.fragment(param)
        if fragment is not None:
            yield name, fragment


def _load_untrained(module: nn.Module, file: Path) -> None:
    """The buffers and frozen weights, which the optimizer does not hold (mapped: only their
    bytes are read)."""
    saved: dict[str, Any] = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
    current = module.state_dict(keep_vars=True)
    missing = sorted(current.keys() - saved.keys() - base_weights(module))
    if missing:
        raise CheckpointError(f"{file} lacks {', '.join(missing[:5])}: written for another model")
    module.load_state_dict(
        {
            name: saved[name]
            for name, value in current.items()
            if name in saved and not (isinstance(value, nn.Parameter) and value.requires_grad)
        },
        strict=False,
    )


def _rank_file(rank: int) -> str:
    return f"{FRAGMENTS_DIR}/rank_{rank:05d}.pt"
