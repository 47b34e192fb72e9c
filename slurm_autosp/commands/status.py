"""python -m slurm_autosp status RUN_DIR [--follow]

Where a run stands, from its directory alone: steps done, the last good checkpoint, the
checkpoints jobs set aside as damaged, the jobs that trained it, how often it was requeued,
and whether a job holds it now. --follow then
streams rank 0's log of the SLURM job holding the run until it ends (Ctrl-C detaches).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import submitit

from slurm_autosp.checkpoint.manifest import MANIFEST, list_files, read_manifest
from slurm_autosp.checkpoint.store import (
    DAMAGE_NOTE,
    TRAINER_STATE,
    checkpoints_newest_first,
    damaged_checkpoints,
)
from slurm_autosp.cluster.scheduler import Liveness
from slurm_autosp.commands.arguments import REFUSED, config_error, take_flag
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.launch.watch import follow
from slurm_autosp.lifecycle.lock import holder_liveness, read_lock
from slurm_autosp.lifecycle.requeue import recorded_requeues
from slurm_autosp.lifecycle.run_dir import RunDir


def last_good_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose manifest lists every file at its recorded size (checksums
    are verified when a job resumes)."""
    for candidate in checkpoints_newest_first(RunDir(run_dir).checkpoints):
        try:
            files = read_manifest(candidate)["files"]
            json.loads((candidate / TRAINER_STATE).read_text())["step"]
            present = set(list_files(candidate))
            if all(
                name in present and (candidate / name).stat().st_size == rec["size"]
                for name, rec in files.items()
            ):
                return candidate
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a malformed manifest or trainer state: not a good checkpoint
    return None


def describe(run_dir: Path) -> list[str]:
    lines = [f"run {run_dir}"]
    steps = _planned_steps(run_dir)
    good = last_good_checkpoint(run_dir)
    if good is None:
        lines.append(f"steps done: 0{f' of {steps}' if steps else ''} (no complete checkpoint)")
    else:
        state = json.loads((good / TRAINER_STATE).read_text())
        lines.append(f"steps done: {state['step']}{f' of {steps}' if steps else ''}")
        lines.append(
            f"last good checkpoint: {good} ({len(read_manifest(good)['files'])} files in {MANIFEST}, "
            f"engine {state.get('engine', 'deepspeed_zero1')}, {state['world_size']} ranks)"
        )
    lines += _damaged(run_dir)
    jobs = sorted(
        {p.name.split("_")[0] for p in RunDir(run_dir).submitit.glob("*_submitted.pkl")},
        key=_job_order,
    )
    lines.append(f"jobs: {', '.join(jobs) if jobs else 'none'}")
    lines.append(f"requeues: {len(recorded_requeues(run_dir))}")
    lines.append(_lock_state(run_dir))
    export, adapters = RunDir(run_dir).hf_export, RunDir(run_dir).adapter_export
    if export.is_dir():
        lines.append(f"Hugging Face export: {export}")
    if adapters.is_dir():
        lines.append(f"LoRA adapters (PEFT's format, on model.pretrained_path): {adapters}")
    return lines


def _damaged(run_dir: Path) -> list[str]:
    """The checkpoints jobs set aside, each with what was wrong, and how to remove them."""
    damaged = damaged_checkpoints(RunDir(run_dir).checkpoints)
    if not damaged:
        return []
    lines = [f"damaged checkpoints set aside: {len(damaged)} (kept for you to inspect)"]
    for path in damaged:
        try:
            why = (path / DAMAGE_NOTE).read_text().strip().replace("\n", "; ")
        except OSError:
            why = "no note of what was wrong"
        lines.append(f"  {path}: {why}")
    lines.append(
        "  remove them with rm -r, or let the next job do it (checkpoint.remove_damaged=true)"
    )
    return lines


def _planned_steps(run_dir: Path) -> int | None:
    """train.steps of the run's config, read as a job reads it; None without a readable one."""
    config = RunDir(run_dir).config
    if not config.exists():
        return None
    try:
        return load_config([f"cfg={config}"]).train.steps
    except ConfigError:
        return None


def _lock_state(run_dir: Path) -> str:
    try:
        lock = read_lock(run_dir)
    except ConfigError as err:
        return f"unknown: {err}"
    if lock is None:
        return "not running"
    liveness, why = holder_liveness(lock)
    if liveness is Liveness.alive:
        return f"running: {lock.describe()}"
    if liveness is Liveness.gone:
        return f"not running (stale lock of {lock.describe()})"
    return f"held by {lock.describe()}, which cannot be checked ({why})"


def _job_order(job_id: str):
    return (0, int(job_id)) if job_id.isdigit() else (1, job_id)


def holding_job(run_dir: Path) -> submitit.SlurmJob:
    """The SLURM job that holds the run, to follow; a ConfigError says why there is none."""
    lock = read_lock(run_dir)
    if lock is None or lock.backend != "slurm":
        held = "no job holds it" if lock is None else f"it is held by {lock.describe()}"
        raise ConfigError(
            f"{run_dir}: no SLURM job to follow ({held}); a local job is followed by the "
            "submit that started it"
        )
    config = RunDir(run_dir).config
    world_size = load_config([f"cfg={config}"]).cluster.world_size
    return submitit.SlurmJob(RunDir(run_dir).submitit, lock.job_id, tasks=tuple(range(world_size)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    argv, follows = take_flag(argv, "--follow")
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else REFUSED
    run_dir = Path(argv[0])
    if not run_dir.is_dir():
        print(
            f"error: {run_dir}: no such run directory (it is <run.output_root>/<run.name>)",
            file=sys.stderr,
        )
        return REFUSED
    print("\n".join(describe(run_dir)), flush=True)
    if not follows:
        return 0
    try:
        job = holding_job(run_dir)
    except ConfigError as err:
        return config_error(err)
    return follow(job, run_dir)
