"""Atomic checkpoints on shared storage, and finding the newest good one to resume from.

A save writes everything under a temporary name (the engine's state in its own format:
DeepSpeed's model and ZeRO-1 shards, or FSDP2's per-rank shards; each rank's RNG state; the
trainer state), checksums it in parallel across ranks, writes the
manifest, and only then renames the directory into place and moves the `latest` pointer. A
save that dies half-way leaves a `.partial` directory that is never resumed from; the last
good checkpoint is untouched until a newer one is complete, and retention deletes only
older ones.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from slurm_autosp.checkpoint.identity import differences, is_identity, refusal
from slurm_autosp.checkpoint.manifest import (
    FileRecord,
    hash_files,
    list_files,
    my_share,
    read_manifest,
    verify_share,
    write_manifest,
)
from slurm_autosp.config import ConfigError

log = logging.getLogger(__name__)

LATEST = "latest"
ENGINE_TAG = "engine"
TRAINER_STATE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed; the message says which and why."""


class EngineState(Protocol):
    """What a checkpoint needs of an engine (engine.base.TrainEngine has it): its name, recorded
    so that a checkpoint resumes only under the engine that wrote it, and its own format."""

    name: str

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...


@dataclass(frozen=True)
class TrainerState:
    """What the engine does not save but an exact resume needs."""

    step: int  # optimizer steps completed
    samples_consumed: int  # the data position: global sample index of the next sample
    world_size: int
    layout: str
    # the engine whose format `engine/` is in (before FSDP2: ZeRO-1)
    engine: str = "deepspeed_zero1"
    # the run's resolved config (identity.run_settings); None: older
    settings: dict[str, Any] | None = None

    @classmethod
    def read(cls, checkpoint: Path) -> TrainerState:
        """Checkpoints written before `settings` carry an opaque `config_hash` instead, never read."""
        data = json.loads((checkpoint / TRAINER_STATE).read_text())
        return cls(**{k: v for k, v in data.items() if k != "config_hash"})


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_dir_problem(root: Path) -> str:
    """Why `root` cannot hold this run's checkpoints ("" if it can): it must be a directory we
    can write, and one other users cannot, since resuming unpickles what DeepSpeed and DCP
    wrote there. A directory the group can write (teams share runs that way) is warned about."""
    probe = root / f".write-probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        return f"checkpoint directory {root} is not writable ({err.strerror or err})"
    mode = root.stat().st_mode
    if mode & stat.S_IWOTH:
        return (
            f"checkpoint directory {root} is writable by every user, and resuming loads files from it; "
            f"chmod o-w {root}"
        )
    if mode & stat.S_IWGRP:
        log.warning(
            "checkpoint directory %s is writable by its group: anyone in it can change what a resume loads",
            root,
        )
    return ""


class CheckpointStore:
    """All ranks call `save` and `load_latest` together; rank 0 does the bookkeeping."""

    def __init__(self, root: Path, rank: int, world_size: int, keep: int):
        if keep < 1:
            raise CheckpointError(
                f"checkpoint.keep={keep}: at least the checkpoint just written must be kept"
            )
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        # checkpoints that failed verification: never kept in place of good ones
        self._failed: set[Path] = set()

    def check_writable(self) -> None:
        """Fail before training, not at the first save an hour later (submit checked it too,
        but the directory can change while the job waits in the queue)."""
        problem = ""
        if self.rank == 0:
            problem = checkpoint_dir_problem(self.root)
            if not problem:
                self._remove_stale_partials()
        problem = _broadcast(problem)
        if problem:
            raise CheckpointError(f"{problem}; choose a writable run.output_root on shared storage")

    def _remove_stale_partials(self) -> None:
        """Half-written saves of a killed job (the run lock means no other job writes here now)."""
        for partial in self.root.glob(".step_*.partial"):
            log.warning("removing %s, a save that never completed", partial)
            shutil.rmtree(partial, ignore_errors=True)

    def save(self, engine: EngineState, state: TrainerState) -> Path:
        final = self.root / step_dir_name(state.step)
        partial = self.root / f".{final.name}.partial"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            (partial / "rng").mkdir(parents=True)
        dist.barrier()
        engine.save(partial / ENGINE_TAG)
        torch.save(_rng_state(), partial / "rng" / f"rank_{self.rank:05d}.pt")
        if self.rank == 0:
            (partial / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=1))
        dist.barrier()
        files = list_files(partial)
        records: dict[str, FileRecord] = {}
        for share in _all_gather(
            hash_files(partial, my_share(files, self.rank, self.world_size), fsync=True)
        ):
            records.update(share)
        if self.rank == 0:
            write_manifest(partial, records, asdict(state))
            self._commit(partial, final)
        dist.barrier()
        return final

    def _commit(self, partial: Path, final: Path) -> None:
        if final.exists():
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(self.root)
        pointer = self.root / f".{LATEST}.tmp"
        pointer.write_text(final.name)
        with open(pointer) as f:
            os.fsync(f.fileno())
        os.replace(pointer, self.root / LATEST)
        _fsync_dir(self.root)
        size = sum((final / n).stat().st_size for n in list_files(final))
        log.info("checkpoint %s saved (%.1f MiB)", final, size / 2**20)
        good = [c for c in self.checkpoints() if c not in self._failed]
        for old in [*good[self.keep :], *self._failed]:
            log.info(
                "removing checkpoint %s (%s)",
                old,
                "failed verification" if old in self._failed else "retention",
            )
            shutil.rmtree(old, ignore_errors=True)
        self._failed.clear()

    def checkpoints(self) -> list[Path]:
        return checkpoints_newest_first(self.root)

    def load_latest(self, engine: EngineState, settings: dict[str, Any]) -> TrainerState | None:
        """Resume from the newest checkpoint that verifies (skip and name the others), if it
        belongs to the run this job's `settings` (identity.run_settings) describe."""
        for candidate in self.checkpoints():
            problems = self._verify(candidate)
            if problems:
                if self.rank == 0:
                    log.warning("skipping checkpoint %s: %s", candidate, "; ".join(problems))
                self._failed.add(candidate)
                continue
            state = TrainerState.read(candidate)
            self._check_same_run(candidate, state, settings)
            if state.world_size != self.world_size:
                raise CheckpointError(
                    f"checkpoint {candidate} was written by {state.world_size} ranks but this job has "
                    f"{self.world_size}; resume with the same cluster.nodes and GPUs per node, or "
                    "start a new run (run.name=...)"
                )
            if state.engine != engine.name:
                raise CheckpointError(
                    f"checkpoint {candidate} was written by the {state.engine} engine but this job uses "
                    f"{engine.name}; resume with the parallel.zero_stage it was written with, or start "
                    "a new run (run.name=...)"
                )
            engine.load(candidate / ENGINE_TAG)
            _set_rng_state(
                torch.load(candidate / "rng" / f"rank_{self.rank:05d}.pt", weights_only=True)
            )
            if self.rank == 0:
                log.info("resumed from %s at step %d", candidate, state.step)
            return state
        return None

    def _check_same_run(
        self, candidate: Path, state: TrainerState, settings: dict[str, Any]
    ) -> None:
        """Refuse a checkpoint of another run, naming every identity key that differs; name the
        harmless changes. The data position continues from `samples_consumed`: it must be
        where this job's step count and global batch put it, or samples would be skipped or repeated."""
        if state.settings is None:
            if self.rank == 0:
                log.warning(
                    "checkpoint %s records no run settings (written by an older version): whether it "
                    "belongs to this run's model, data and layout is not checked",
                    candidate,
                )
        else:
            changed = differences(state.settings, settings)
            refused = [d for d in changed if is_identity(d.key)]
            if refused:
                raise CheckpointError(refusal(candidate, refused, settings["run.name"]))
            if changed and self.rank == 0:
                log.info("resuming with changed settings: %s", "; ".join(map(str, changed)))
        global_batch = settings["train.global_batch"]
        if state.samples_consumed != state.step * global_batch:
            raise CheckpointError(
                f"checkpoint {candidate} is at sample {state.samples_consumed} after {state.step} steps, but this "
                f"job's global batch of {global_batch} (train.micro_batch x train.grad_accum x data-parallel ranks) "
                f"would continue at sample {state.step * global_batch}: resume with the batch it was written "
                f"with, or start a new run with another run.name"
            )

    def _verify(self, candidate: Path) -> list[str]:
        try:
            manifest = read_manifest(candidate)
            problems = verify_share(candidate, manifest, self.rank, self.world_size)
        except (OSError, ValueError, KeyError, TypeError) as err:
            problems = [str(err)]
        return sorted({p for share in _all_gather(problems) for p in share})


def checkpoints_newest_first(root: Path) -> list[Path]:
    """The checkpoint directories under `root`, newest first (the `latest` pointer's target
    leading)."""
    if not root.is_dir():
        return []
    found = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    pointer = root / LATEST
    if pointer.exists():
        target = root / pointer.read_text().strip()
        if target in found:
            found.remove(target)
            found.insert(0, target)
    return found


def refuse_another_runs_checkpoint(root: Path, settings: dict[str, Any]) -> None:
    """Before a job is queued: the checkpoint it would resume from, the newest whose save
    finished (its manifest written; the job verifies the files), must be of the run `settings`
    describe. Otherwise the job would be refused only at its start, after its wait in the
    queue. The layout is left to the job, whose nodes decide it."""
    for candidate in checkpoints_newest_first(root):
        try:
            read_manifest(candidate)
            state = TrainerState.read(candidate)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # the job skips it too
        if state.settings is None:
            return  # written before settings were recorded: the job warns
        changed = differences(state.settings, settings)
        refused = [d for d in changed if is_identity(d.key) and d.key != "parallel.layout"]
        if refused:
            raise ConfigError(refusal(candidate, refused, settings["run.name"]))
        return


def _all_gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    """Every generator's state as tensors, ints and strings only, so it loads with weights_only=True."""
    version, mt, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=True)
    assert isinstance(numpy_state, tuple)  # the legacy form: MT19937 keys and position
    kind, keys, pos, has_gauss, cached = numpy_state
    state: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
