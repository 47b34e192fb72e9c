"""Atomic checkpoints on shared storage, and finding the newest good one to resume from.

A save writes everything under a temporary name (the engine's state in its own format, which
resumes on any world size and SP x DP layout: ZeRO-1's per-parameter pieces, engine/
zero1_checkpoint.py, or FSDP2's torch distributed checkpoint; each rank's RNG state; the
trainer state), checksums it in parallel across ranks, writes the
manifest, and only then renames the directory into place and moves the `latest` pointer. A
save that dies half-way leaves a `.partial` directory that is never resumed from; the last
good checkpoint is untouched until a newer one is complete.

Nothing good is ever deleted. A checkpoint that fails verification at resume is moved aside
as `damaged_step_*` (kept for the user to inspect; `checkpoint.remove_damaged` or the user
removes it), and retention deletes a checkpoint only once `keep` newer ones are known good
(verified at resume or written by this job). A checkpoint that cannot be read (an I/O or
permission error) is not damaged: the job stops naming the file, rather than resume from an
older checkpoint or from step 0.

Two starts of one job can live at once (lifecycle/lock.py): the earlier, superseded one must
change nothing the later one reads. So rank 0 asks the fence immediately before each change
(making a save's directory, the manifest, each rename, moving `latest`, each deletion), and
never moves `latest` back: a commit stops when `latest` names a checkpoint at its step or later,
which holds even where a fence check races the takeover.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from slurm_autosp.checkpoint.identity import dropout_of, refusal, refused
from slurm_autosp.checkpoint.manifest import (
    FileRecord,
    ShareCheck,
    hash_files,
    is_missing,
    list_files,
    my_share,
    read_manifest,
    verify_share,
    write_manifest,
)
from slurm_autosp.checkpoint.state_files import StateFiles
from slurm_autosp.config import ConfigError
from slurm_autosp.lifecycle.durable import fsync_path, rename_durably
from slurm_autosp.lifecycle.run_dir import checkpoint_dir_problem

log = logging.getLogger(__name__)

LATEST = "latest"
ENGINE_TAG = "engine"
TRAINER_STATE = "trainer_state.json"
DAMAGED = "damaged_"  # the prefix of a checkpoint set aside because it failed verification
DAMAGE_NOTE = "damaged.txt"  # inside it: what was wrong, for the user who inspects it


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed; the message says which and why."""


class EngineState(Protocol):
    """What a checkpoint needs of an engine (engine.base.TrainEngine has it): its name, recorded
    so that a checkpoint resumes only under the engine that wrote it, its model, and its own
    format."""

    name: str
    module: nn.Module

    def state_files(self) -> StateFiles: ...

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


class CheckpointStore:
    """All ranks call `save` and `load_latest` together; rank 0 does the bookkeeping."""

    def __init__(
        self,
        root: Path,
        rank: int,
        world_size: int,
        keep: int,
        remove_damaged: bool = False,
        fence: Callable[[], str] = lambda: "",
    ):
        """`fence`, asked by rank 0 immediately before each change to the checkpoints: why
        this job may no longer write the run (another start of it holds the run's lock); empty
        while it may."""
        if keep < 1:
            raise CheckpointError(
                f"checkpoint.keep={keep}: at least the checkpoint just written must be kept"
            )
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.remove_damaged = remove_damaged
        self.fence = fence
        # checkpoints known good: verified at resume, or written by this job
        self._verified: set[Path] = set()
        # the checkpoints this job set aside as damaged, with what was wrong with each
        self.set_aside: list[SetAside] = []

    def check_writable(self) -> None:
        """Fail before training, not at the first save an hour later (submit checked it too,
        but the directory can change while the job waits in the queue)."""
        self._by_rank0(self._writable)

    def _writable(self) -> str:
        problem = checkpoint_dir_problem(self.root)
        if problem:
            return f"{problem}; choose a writable run.output_root on shared storage"
        return self._remove_stale_saves()

    def _remove_stale_saves(self) -> str:
        """Half-written saves of a killed job and its `latest` pointers never moved into place
        (the run lock means no other job writes here now); why not, if fenced."""
        for stale in [*self.root.glob(".step_*.partial"), *self.root.glob(f".{LATEST}*.tmp")]:
            log.warning("removing %s, a save that never completed", stale)
            if problem := self._remove_unless_fenced(stale):
                return problem
        return ""

    def save(self, engine: EngineState, state: TrainerState) -> Path:
        """Collective and synchronous: every rank writes its part straight to shared storage,
        then hashes its share of the files."""
        return self.write(self.state_files(engine, state), state)

    def write(self, files: StateFiles, state: TrainerState) -> Path:
        """Collective and synchronous: `save`, of this rank's part already made into `files`
        (an asynchronous save's staged copy, when it could not be written in the background)."""
        partial, final = self.begin(state)
        files.write(partial)
        dist.barrier()
        written = list_files(partial)
        records: dict[str, FileRecord] = {}
        for share in _all_gather(
            hash_files(partial, my_share(written, self.rank, self.world_size), fsync=True)
        ):
            records.update(share)
        return self.finish(partial, final, records, state)

    def paths(self, state: TrainerState) -> tuple[Path, Path]:
        """The save's `.partial` directory and the name it will have once complete."""
        final = self.root / step_dir_name(state.step)
        return self.root / f".{final.name}.partial", final

    def begin(self, state: TrainerState) -> tuple[Path, Path]:
        """Collective: rank 0 makes the save's empty `.partial` directory; returns `paths`."""
        partial, final = self.paths(state)
        self._by_rank0(lambda: self._make_partial(partial, state.step))
        return partial, final

    def _make_partial(self, partial: Path, step: int) -> str:
        if problem := self._fenced(f"not saving step {step}"):
            return problem
        _remove(partial)
        partial.mkdir(parents=True)
        return ""

    def _remove_unless_fenced(self, path: Path, what: str = "") -> str:
        """Rank 0: remove `path`, or say why not (`what`: the removal's context)."""
        if problem := self._fenced(f"{what}not removing {path}"):
            return problem
        _remove(path)
        return ""

    def state_files(self, engine: EngineState, state: TrainerState) -> StateFiles:
        """Collective: this rank's part of the save, by path in the checkpoint: the engine's
        state in its own format, the rank's RNG state, rank 0's trainer state."""
        files = engine.state_files().under(ENGINE_TAG)
        files.trees[f"rng/rank_{self.rank:05d}.pt"] = rng_state()
        if self.rank == 0:
            files.texts[TRAINER_STATE] = json.dumps(asdict(state), indent=1)
        return files

    def finish(
        self, partial: Path, final: Path, records: dict[str, FileRecord], state: TrainerState
    ) -> Path:
        """Collective, once every rank's files are in `partial` with their `records`: rank 0
        writes the manifest, renames the checkpoint into place and moves `latest`; every rank
        raises CheckpointError where the fence or `latest` stopped it."""
        self._by_rank0(lambda: self._commit(partial, final, records, state))
        return final

    def abandon(self, partial: Path) -> None:
        """Collective: a save that will not complete is removed; `latest` never saw it."""
        self._by_rank0(lambda: self._remove_unless_fenced(partial))

    def _by_rank0(self, change: Callable[[], str]) -> None:
        """Collective: rank 0 makes `change`, which returns why it stopped (empty: made); every
        rank then raises that, so all stop together."""
        problem = _broadcast(change() if self.rank == 0 else "")
        if problem:
            raise CheckpointError(problem)

    def _fenced(self, what: str) -> str:
        """Rank 0, immediately before a change: `what` was not done and why, if fenced."""
        problem = self.fence()
        return f"{what}: {problem}" if problem else ""

    def _refused(self, final: Path, what: str, *, renamed: bool) -> str:
        """Rank 0, immediately before a commit's change: the fence's reason, or `latest` naming
        a checkpoint after `final`, or `final` itself before this commit `renamed` its own into
        place (another start of the job committed it: moving `latest` back, or that checkpoint
        aside, would lose it)."""
        if problem := self._fenced(what):
            return problem
        try:
            named = (self.root / LATEST).read_text().strip()
        except FileNotFoundError:
            return ""
        later = named > final.name or (named == final.name and not renamed)
        if later and (self.root / named).is_dir():
            return f"{what}: {LATEST} names {named}, not older than {final.name}"
        return ""

    def _commit(
        self, partial: Path, final: Path, records: dict[str, FileRecord], state: TrainerState
    ) -> str:
        """Rank 0; returns why it stopped, empty once committed. Stopped before `latest` moves,
        the checkpoint may be in place, complete but never named: retention removes it later."""
        what = f"not committing step {state.step} ({partial} left as it is)"
        if problem := self._refused(final, what, renamed=False):
            return problem
        write_manifest(partial, records, asdict(state))
        if final.exists():  # only if `latest` pointed below it: a checkpoint never verified
            _move_aside(final, ["a newer save of the same step replaced it"])
        rename_durably(partial, final, files=False)  # each file was forced as it was hashed
        pointer = self.root / f".{LATEST}.{uuid.uuid4().hex}.tmp"  # another start's is its own
        pointer.write_text(final.name)
        with open(pointer) as f:
            os.fsync(f.fileno())
        if problem := self._refused(final, f"not moving {LATEST} to {final.name}", renamed=True):
            pointer.unlink()
            return problem
        os.replace(pointer, self.root / LATEST)
        fsync_path(self.root)
        size = sum((final / n).stat().st_size for n in list_files(final))
        log.info("checkpoint %s saved (%.1f MiB)", final, size / 2**20)
        self._verified.add(final)
        return self._retain(final) or self._remove_damaged(final)

    def _retain(self, final: Path) -> str:
        """Delete the checkpoints older than the `keep` newest known good ones; while fewer
        are known good, delete nothing (an older checkpoint never verified may be all there is).
        Why it stopped, if fenced."""
        found = sorted(self.checkpoints(), reverse=True)
        good = [c for c in found if c in self._verified][: self.keep]
        if len(good) < self.keep:
            return ""
        for old in found:
            if old.name < good[-1].name:
                log.info("removing checkpoint %s (retention: checkpoint.keep=%d)", old, self.keep)
                if problem := self._remove_unless_fenced(old, f"{final.name} saved, but "):
                    return problem
        return ""

    def _remove_damaged(self, final: Path) -> str:
        """With checkpoint.remove_damaged, the damaged checkpoints `final` has gone past, never
        the others. Why it stopped, if fenced."""
        if not self.remove_damaged:
            return ""
        for damaged in damaged_checkpoints(self.root):
            if damaged_step(damaged) < damaged_step(final):
                log.info("removing %s (checkpoint.remove_damaged=true)", damaged)
                if problem := self._remove_unless_fenced(damaged, f"{final.name} saved, but "):
                    return problem
        return ""

    def checkpoints(self) -> list[Path]:
        return checkpoints_newest_first(self.root)

    def load_latest(self, engine: EngineState, settings: dict[str, Any]) -> TrainerState | None:
        """Resume from the newest checkpoint that verifies, if it belongs to the run this job's
        `settings` (identity.run_settings) describe. Newer ones that fail verification are moved
        aside, named in the log; one that cannot be read stops the job (CheckpointError)."""
        for candidate in self._agreed_candidates():
            damage = self._verify(candidate)
            if damage:
                self._set_aside(candidate, damage)
                continue
            state = TrainerState.read(candidate)
            self._check_same_run(candidate, state, settings)
            relaid = self._check_relaid(candidate, state, settings, engine.module)
            if state.engine != engine.name:
                raise CheckpointError(
                    f"checkpoint {candidate} was written by the {state.engine} engine but this job uses "
                    f"{engine.name}; resume with the parallel.zero_stage it was written with, or start "
                    "a new run (run.name=...)"
                )
            engine.load(candidate / ENGINE_TAG)
            rng_of = 0 if relaid else self.rank
            set_rng_state(
                torch.load(candidate / "rng" / f"rank_{rng_of:05d}.pt", weights_only=True), relaid
            )
            self._verified.add(candidate)
            if self.rank == 0:
                log.info("resumed from %s at step %d", candidate, state.step)
            return state
        self._refuse_only_damaged()
        return None

    def _refuse_only_damaged(self) -> None:
        """No checkpoint to resume from, but damaged ones set aside (by this job or an earlier
        one): starting again from step 0 would throw the run's progress away without a word."""
        damaged = _broadcast(
            [p.name for p in damaged_checkpoints(self.root)] if self.rank == 0 else []
        )
        if damaged:
            raise CheckpointError(only_damaged(self.root, damaged, self.set_aside))

    def _agreed_candidates(self) -> list[Path]:
        """Rank 0's listing, for every rank: they verify the same checkpoints in step."""
        listing: list[Path] | str = []
        if self.rank == 0:
            try:
                listing = self.checkpoints()
            except OSError as err:
                listing = f"{err.filename or self.root}: {err.strerror or err}"
        listing = _broadcast(listing)
        if isinstance(listing, str):
            raise CheckpointError(_unreadable([listing]))
        return listing

    def _set_aside(self, candidate: Path, damage: list[str]) -> None:
        """Rank 0 moves a damaged checkpoint aside; every rank learns where it went."""
        outcome = ""
        if self.rank == 0:
            try:
                outcome = str(_move_aside(candidate, damage))
            except OSError as err:
                outcome = f"error: {err}"
        outcome = _broadcast(outcome)
        if outcome.startswith("error: "):
            raise CheckpointError(
                f"checkpoint {candidate} is damaged ({'; '.join(damage)}) and cannot be moved "
                f"aside ({outcome.removeprefix('error: ')}): move it out of {self.root} yourself "
                "and submit again"
            )
        self.set_aside.append(SetAside(candidate.name, Path(outcome), damage))
        if self.rank == 0:
            log.warning(
                "skipping checkpoint %s, damaged: %s; moved aside to %s, kept for you to inspect",
                candidate,
                "; ".join(damage),
                outcome,
            )

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
            identity, changed = refused(state.settings, settings)
            if identity:
                raise CheckpointError(refusal(candidate, identity, settings["run.name"]))
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

    def _check_relaid(
        self, candidate: Path, state: TrainerState, settings: dict[str, Any], model: nn.Module
    ) -> bool:
        """Whether `candidate` was written on another world size or SP x DP layout (logged).

        The engines' formats reshard, and the data position is a global sample index that
        `micro_batch` maps to the same global batch in any layout. What does not carry over is
        each rank's RNG state: no saved rank did a rank's work in another layout, so every rank
        restores rank 0's (every rank of a run starts from the same seed). Training draws from
        these generators for dropout only, whose masks each rank draws over its own rows and
        sequence shard: a model with dropout is refused another layout, which could not take
        the steps the run would have taken."""
        layout = settings.get("parallel.layout")
        if state.world_size == self.world_size and state.layout == layout:
            return False
        dropout = dropout_of(model)
        if dropout:
            raise CheckpointError(
                f"checkpoint {candidate} was written on {state.world_size} ranks ({state.layout}); "
                f"this job runs {layout}. The model trains with dropout ({'; '.join(dropout)}), "
                "whose random masks each rank draws for its own rows and sequence shard, so another "
                "layout cannot continue the run exactly: resume it on the cluster.nodes, GPUs per "
                "node and parallel.sp_size it was written with, or start a new run with another run.name"
            )
        if self.rank == 0:
            log.info(
                "resuming on another layout: checkpoint %s was written on %s; every rank restores "
                "rank 0's RNG state",
                candidate,
                state.layout,
            )
        return True

    def _verify(self, candidate: Path) -> list[str]:
        """What is wrong with `candidate` on any rank (empty: it verifies); a file any rank
        cannot read raises CheckpointError on every rank."""
        check = ShareCheck()
        try:
            manifest = read_manifest(candidate)
            check = verify_share(candidate, manifest, self.rank, self.world_size)
        except ValueError as err:
            check.damage.append(str(err))
        except OSError as err:
            check.unreadable.append(f"{err.filename or candidate}: {err.strerror or err}")
        shares: list[ShareCheck] = _all_gather(check)
        unreadable = sorted({p for share in shares for p in share.unreadable})
        if unreadable:
            raise CheckpointError(_unreadable(unreadable))
        return sorted({p for share in shares for p in share.damage})


@dataclass(frozen=True)
class SetAside:
    """A checkpoint a job moved aside because it failed verification."""

    name: str  # its name before, e.g. step_00000010
    path: Path  # where it is now
    damage: list[str]  # what was wrong

    def __str__(self) -> str:
        return f"{self.name} (now {self.path.name}): {'; '.join(self.damage)}"


def damage_report(set_aside: list[SetAside]) -> str:
    """What a resumed job skipped, for the run's TensorBoard text."""
    return (
        "Checkpoints that failed verification, moved aside (kept for inspection):\n\n"
        + "\n".join(f"- {s}" for s in set_aside)
    )


def _unreadable(what: list[str]) -> str:
    return (
        f"cannot read the run's checkpoints: {'; '.join(what)}. This is a storage or permission "
        "error, not a damaged checkpoint: the job stops rather than resume from an older "
        "checkpoint or from step 0. Fix the storage or the file's permissions and submit again"
    )


def _remove(path: Path) -> None:
    """Remove a save's directory, or whatever file or link is in its place."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _move_aside(checkpoint: Path, why: list[str]) -> Path:
    """Rename `checkpoint` to a `damaged_` name no resume or retention looks at, and note why
    inside it. Returns where it went."""
    aside = checkpoint.with_name(f"{DAMAGED}{checkpoint.name}")
    n = 1
    while aside.exists():
        n += 1
        aside = checkpoint.with_name(f"{DAMAGED}{checkpoint.name}.{n}")
    os.rename(checkpoint, aside)
    fsync_path(checkpoint.parent)
    (aside / DAMAGE_NOTE).write_text("\n".join(why) + "\n")
    return aside


def damaged_checkpoints(root: Path) -> list[Path]:
    """The checkpoints jobs set aside as damaged, oldest step first."""
    return sorted(p for p in root.glob(f"{DAMAGED}step_*") if p.is_dir()) if root.is_dir() else []


def damaged_step(checkpoint: Path) -> int:
    """The step of a checkpoint, set aside (`damaged_step_N`, `damaged_step_N.2`) or not."""
    return int(checkpoint.name.removeprefix(DAMAGED).removeprefix("step_").split(".")[0])


def only_damaged(root: Path, damaged: list[str], set_aside: list[SetAside]) -> str:
    """Why a run whose every checkpoint failed verification does not start again from step 0,
    and the explicit ways to go on."""
    why = "".join(f"\n  - {s}" for s in set_aside)
    return (
        f"every checkpoint of this run failed verification and is set aside in {root} "
        f"({', '.join(damaged)}; what was wrong with each is in its {DAMAGE_NOTE}){why}\n"
        "The job does not start the run again from step 0 on its own. To start over, move the "
        f"{DAMAGED}step_* directories out of {root} (or remove them) and submit again; or start a "
        "new run (run.name=...)"
    )


def checkpoints_newest_first(root: Path) -> list[Path]:
    """The checkpoint directories under `root`, newest first (the `latest` pointer's target
    leading). A directory that cannot be listed raises OSError: no checkpoints is a fact
    about the run, never a guess."""
    try:
        entries = list(os.scandir(root))
    except OSError as err:
        if is_missing(err):
            return []
        raise
    found = sorted(
        (Path(e.path) for e in entries if e.name.startswith("step_") and e.is_dir()),
        reverse=True,
    )
    try:
        target = root / (root / LATEST).read_text().strip()
    except OSError as err:
        if not is_missing(err):
            raise
    else:
        if target in found:
            found.remove(target)
            found.insert(0, target)
    return found


def refuse_another_runs_checkpoint(root: Path, settings: dict[str, Any]) -> None:
    """Before a job is queued: the checkpoint it would resume from, the newest whose save
    finished (its manifest written; the job verifies the files), must be of the run `settings`
    describe. Otherwise the job would be refused only at its start, after its wait in the
    queue. A checkpoint that cannot be read is refused here as the job would refuse it, and
    a run with damaged checkpoints set aside and none other, as the job would refuse it."""
    try:
        candidates = checkpoints_newest_first(root)
        damaged = damaged_checkpoints(root)
        if damaged and not candidates:
            raise ConfigError(only_damaged(root, [p.name for p in damaged], []))
        for candidate in candidates:
            try:
                read_manifest(candidate)
                state = TrainerState.read(candidate)
            except (ValueError, KeyError, TypeError):
                continue  # damaged: the job sets it aside
            except OSError as err:
                if is_missing(err):
                    continue
                raise
            if state.settings is None:
                return  # written before settings were recorded: the job warns
            identity, _ = refused(state.settings, settings)
            if identity:
                raise ConfigError(refusal(candidate, identity, settings["run.name"]))
            return
    except OSError as err:
        raise ConfigError(_unreadable([f"{err.filename or root}: {err.strerror or err}"])) from err


def _all_gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rng_state() -> dict[str, Any]:
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
        # the rank's own GPU's (the current device since the job started), the one generator
        # it draws from: every visible GPU's would not restore where fewer are visible
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any], relaid: bool = False) -> None:
    """Restore what `rng_state` returned; `relaid`: rank 0's state, restored on another layout
    (rank 0's GPU was its device 0: cluster.distributed.rank_device_index)."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saver_device = 0 if relaid else torch.cuda.current_device()
        torch.cuda.set_rng_state(cuda_rng_state(state["cuda"], saver_device))


def cuda_rng_state(saved: torch.Tensor | list[torch.Tensor], device: int) -> torch.Tensor:
    """The CUDA generator state in a saved RNG state, the saving rank's GPU's (`device`: its
    index). Checkpoints written before hold every visible GPU's: `device`'s entry, or the only
    GPU's where the saver saw fewer."""
    if isinstance(saved, torch.Tensor):
        return saved
    return saved[device] if device < len(saved) else saved[0]
