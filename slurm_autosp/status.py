"""python -m slurm_autosp.status RUN_DIR

Where a run stands, from its directory alone: steps done, the last good checkpoint, the jobs
that trained it, how often it was requeued, and whether a job holds it now.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from slurm_autosp.checkpoint.lock import Liveness, holder_liveness, read_lock
from slurm_autosp.checkpoint.manifest import MANIFEST, list_files, read_manifest
from slurm_autosp.checkpoint.schedule import checkpoint_dir
from slurm_autosp.checkpoint.store import TRAINER_STATE, CheckpointStore
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.launch.executor import submitit_dir
from slurm_autosp.launch.requeue import recorded_requeues


def last_good_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose manifest lists every file at its recorded size (checksums
    are verified when a job resumes)."""
    store = CheckpointStore(checkpoint_dir(run_dir), rank=0, world_size=1, keep=1)
    for candidate in store.checkpoints():
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
        lines.append(
            f"steps done: 0{f' of {steps}' if steps else ''} (no complete checkpoint)"
        )
    else:
        state = json.loads((good / TRAINER_STATE).read_text())
        lines.append(f"steps done: {state['step']}{f' of {steps}' if steps else ''}")
        lines.append(
            f"last good checkpoint: {good} ({len(read_manifest(good)['files'])} files in {MANIFEST}, "
            f"engine {state.get('engine', 'deepspeed_zero1')}, {state['world_size']} ranks)"
        )
    jobs = sorted(
        {p.name.split("_")[0] for p in submitit_dir(run_dir).glob("*_submitted.pkl")},
        key=_job_order,
    )
    lines.append(f"jobs: {', '.join(jobs) if jobs else 'none'}")
    lines.append(f"requeues: {len(recorded_requeues(run_dir))}")
    lines.append(_lock_state(run_dir))
    if (run_dir / "hf").is_dir():
        lines.append(f"Hugging Face export: {run_dir / 'hf'}")
    return lines


def _planned_steps(run_dir: Path) -> int | None:
    """train.steps of the run's config, read as a job reads it; None without a readable one."""
    config = run_dir / "config.yaml"
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    run_dir = Path(argv[0])
    if not run_dir.is_dir():
        print(
            f"error: {run_dir}: no such run directory (it is <run.output_root>/<run.name>)",
            file=sys.stderr,
        )
        return 2
    print("\n".join(describe(run_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
