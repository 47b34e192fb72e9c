"""What a run directory holds, named in one place: `status`, `summary`, a resumed job and a
user's own scripts find a run's files by these names, so no other module spells them. Also
how earlier configs are kept, and the check that the checkpoint directory is safe to use."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunDir:
    """The paths under a run's directory, `<run.output_root>/<run.name>`."""

    root: Path

    @property
    def config(self) -> Path:
        """The resolved config the latest submission runs with (the plan's choices frozen in)."""
        return self.root / "config.yaml"

    @property
    def earlier_configs(self) -> Path:
        """The configs earlier submissions ran with, one file each, never overwritten."""
        return self.root / "configs"

    def earlier_config(self, number: int) -> Path:
        """The config the `number`th submission (from 1) ran with, once a later one replaced it."""
        return self.earlier_configs / f"config.{number:04d}.yaml"

    @property
    def submitit(self) -> Path:
        """submitit's folder: the pickled job, each rank's log and result."""
        return self.root / "submitit"

    @property
    def checkpoints(self) -> Path:
        """The checkpoint store's folder (its step_N, latest and damaged_step_N are its own)."""
        return self.root / "checkpoints"

    @property
    def hf_export(self) -> Path:
        """The trained weights and tokenizer in Hugging Face format."""
        return self.root / "hf"

    @property
    def hf_export_partial(self) -> Path:
        """An export being written, renamed to `hf_export` once complete."""
        return self.root / ".hf.partial"

    @property
    def hf_export_previous(self) -> Path:
        """The export being replaced, while the new one is renamed into place."""
        return self.root / ".hf.previous"

    @property
    def adapter_export(self) -> Path:
        """A LoRA run's trained adapters in PEFT's format, with the tokenizer."""
        return self.root / "adapter"

    @property
    def adapter_export_partial(self) -> Path:
        return self.root / ".adapter.partial"

    @property
    def adapter_export_previous(self) -> Path:
        return self.root / ".adapter.previous"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard's event files: the run's scalars and texts (the probe's too)."""
        return self.root / "tensorboard"

    @property
    def memory_traces(self) -> Path:
        """Memory traces (JSON, PNG) and PyTorch memory snapshots, next to the event files."""
        return self.tensorboard / "memory"

    @property
    def flight_recorder_prefix(self) -> Path:
        """What the NCCL flight recorder's per-rank dump files start with (rank number follows)."""
        return self.root / "flight_recorder" / "rank_"

    @property
    def lock(self) -> Path:
        """The run's lock: which job trains the run (lifecycle.lock)."""
        return self.root / "job.lock"

    def lock_temporary(self, token: str) -> Path:
        """A complete lock file, written aside and then hard-linked into place as `lock`."""
        return self.root / f".{self.lock.name}.{token}"

    def lock_takeover(self, inode: int, mtime_ns: int) -> Path:
        """The claim of one taker of a stale lock, named by the stale file's identity."""
        return self.root / f".{self.lock.name}.takeover.{inode}.{mtime_ns}"

    @property
    def requeues(self) -> Path:
        """A JSON line per requeue of the run."""
        return self.root / "requeues.jsonl"

    @property
    def probe_report(self) -> Path:
        """The probe's findings (a probe has a run directory of its own)."""
        return self.root / "probe.json"

    @property
    def step_time(self) -> Path:
        """The latest measured optimizer step (training's or the probe's), which admission
        holds the signal delay to (lifecycle.save_time.StepTime)."""
        return self.root / "step_time.json"

    @property
    def outside_allocator(self) -> Path:
        """The GPU memory outside torch's allocator a job measured after its first step, which
        the run's next plan counts (metrics.outside_allocator)."""
        return self.root / "outside_allocator.json"

    @property
    def start_check(self) -> Path:
        """The job's exactness check before step 1: its outcome and report, and the torch and
        transformers versions it ran with (verify.start_check)."""
        return self.root / "start_check.json"

    @property
    def probe_run(self) -> RunDir:
        """The run directory of this run's probe, `<run.name>_probe` beside it."""
        return RunDir(self.root.with_name(probe_run_name(self.root.name)))


def probe_run_name(name: str) -> str:
    """The probe of run `name` runs as its own run, so it never touches the run's checkpoints
    or lock, under this name beside it."""
    return f"{name}_probe"


def keep_previous_config(run: RunDir) -> None:
    """A resubmission may change settings a checkpoint allows to change: the config each earlier
    submission ran with stays as configs/config.NNNN.yaml (in submission order), never overwritten."""
    if not run.config.exists():
        return
    run.earlier_configs.mkdir(exist_ok=True)
    number = len(list(run.earlier_configs.glob("config.*.yaml"))) + 1
    while True:
        try:
            with open(run.earlier_config(number), "x") as f:
                f.write(run.config.read_text())
            return
        except FileExistsError:
            number += 1


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
