"""cluster.max_requeues holds for local jobs as on SLURM: the run records each requeue, and a
job signalled once more than it may be requeued stops with the checkpoint saved."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_local_job_stops_requeueing_after_max_requeues(tmp_path):
    run_dir = tmp_path / "tiny_cpu"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slurm_autosp.submit",
            "cfg=configs/tiny_cpu.yaml",
            "cluster.backend=local",
            "cluster.max_requeues=1",
            "train.steps=2000",
            "train.log_every=1",
            f"run.output_root={tmp_path}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def signal_job():
        subprocess.run(
            [
                "pkill",
                f"-{signal.SIGUSR2.name}",
                "-f",
                f"submitit.core._submit {run_dir / 'submitit'}",
            ],
            check=True,
        )

    signalled, resumed, lines = 0, False, []
    for line in proc.stdout:
        lines.append(line)
        resumed = resumed or "resumed from" in line
        if (
            " step " in line
            and "/2000" in line
            and (signalled == 0 or (signalled == 1 and resumed))
        ):
            signal_job()
            signalled += 1
    _, err = proc.communicate(timeout=600)
    out = "".join(lines)
    assert signalled == 2, out
    assert proc.returncode == 1, out + err
    assert "stopped by a signal after 1 requeues (cluster.max_requeues=1)" in out + err
    records = [json.loads(x) for x in (run_dir / "requeues.jsonl").read_text().splitlines()]
    assert [r["restart"] for r in records] == [1]
    status = subprocess.run(
        [sys.executable, "-m", "slurm_autosp.status", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "requeues: 1" in status and "last good checkpoint" in status, status
