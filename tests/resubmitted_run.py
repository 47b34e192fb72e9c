"""A run submitted three times, shared by the TensorBoard and resume-identity tests:
tests/conftest.py's `resubmitted_run` fixture builds it once per session.

tiny_cpu for 6 steps (checkpoints at 3 and 6, memory traces at steps 2 and 5), its last
checkpoint then invalidated (no manifest); submitted again with another model, which submit
refuses before queueing a job (from the step-3 checkpoint it would resume); then for 8 steps: it resumes from step 3, so steps 4-6 and the step-5 trace are logged
twice and TensorBoard must show each once."""

import subprocess
from dataclasses import dataclass
from pathlib import Path

from local_submit import submit_local


@dataclass(frozen=True)
class ResubmittedRun:
    run_dir: Path
    refused: subprocess.CompletedProcess  # the submission with model.hidden_size=96
    resumed: subprocess.CompletedProcess  # the one for 8 steps


def submit(root: Path, *overrides: str) -> subprocess.CompletedProcess:
    return submit_local(
        f"run.output_root={root}",
        "checkpoint.every_steps=3",
        # synchronous: an asynchronous step-3 save still being written at step 6 (the last,
        # synchronous save) is abandoned, leaving no step 3 to resume from under load
        "checkpoint.async_save=false",
        "trace.memory_steps=[2,5]",
        *overrides,
    )


def _succeeded(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def resubmit(root: Path) -> ResubmittedRun:
    _succeeded(submit(root, "train.steps=6"))
    run_dir = root / "tiny_cpu"
    (run_dir / "checkpoints" / "step_00000006" / "manifest.json").unlink()
    refused = submit(root, "train.steps=6", "model.hidden_size=96")
    resumed = _succeeded(submit(root, "train.steps=8"))
    return ResubmittedRun(run_dir, refused, resumed)
