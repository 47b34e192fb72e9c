"""Driving jobs on the local Slurm test cluster from tests."""

import re
import subprocess
import sys
import time
from pathlib import Path

from submitit.core.utils import pickle_load

REPO = Path(__file__).resolve().parents[1]


def submit_cmd(*overrides):
    """submit of tiny_cpu, following the job to its end (on SLURM submit would return)."""
    return [
        sys.executable,
        "-m",
        "slurm_autosp.submit",
        "cfg=configs/tiny_cpu.yaml",
        "follow=true",
        *overrides,
    ]


def final_result(run_dir: Path):
    """Rank 0's TrainResult of the job's last attempt (the newest result: a local job's id is
    a process id, which does not sort by time)."""
    results = (run_dir / "submitit").glob("*_0_result.pkl")
    outcome, result = pickle_load(max(results, key=lambda p: p.stat().st_mtime_ns))
    assert outcome == "success", result
    return result


def job_state(job_id: str) -> str:
    return subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True
    ).stdout.strip()


def has_processes(job_id: str) -> bool:
    """Whether the node still runs a process of the job (its run before a requeue ending)."""
    listed = subprocess.run(["scontrol", "listpids", job_id], capture_output=True, text=True)
    return listed.returncode == 0 and len(listed.stdout.strip().splitlines()) > 1


def release_requeued(job_id: str, timeout_s: float = 300) -> None:
    """Once the job said it stops: it is RUNNING while it saves, then requeued it waits ~120 s
    (its BeginTime); start it then instead, once none of its processes is left on the node and
    the clock has passed the second of the requeue. slurmd revokes the job's credentials as of
    that second, in whole seconds: a start allocated within it is refused ('Job credential
    revoked') and the job fails. Returning while it still saved would leave it to wait out the
    BeginTime."""
    deadline = time.monotonic() + timeout_s
    requeued_at = None  # wall clock, as slurmd's revocation is
    released_at = -1e9
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state == "RUNNING" and requeued_at is not None:
            return
        if state == "" and requeued_at is not None:
            _raise_if_ended(job_id)
        if state not in ("RUNNING", "") and requeued_at is None:  # "": squeue did not answer
            requeued_at = time.time()
        # The update makes it eligible now and runs the scheduler (a StartTime in the future
        # waits for its next periodic pass); again if it did not start.
        if (
            state == "PENDING"
            and time.time() >= int(requeued_at) + 2
            and time.monotonic() - released_at > 5
            and not has_processes(job_id)
        ):
            subprocess.run(
                ["scontrol", "update", f"jobid={job_id}", "StartTime=now"], capture_output=True
            )
            released_at = time.monotonic()
        time.sleep(1)
    raise AssertionError(
        f"job {job_id} did not run again within {timeout_s}s (state {job_state(job_id)!r})"
    )


def _raise_if_ended(job_id: str) -> None:
    """squeue lists no ended job: fail at once, with the controller's word on why it ended."""
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True
    ).stdout
    if m := re.search(r"JobState=(\S+) Reason=(\S+)", shown):
        if m.group(1) not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING"):
            raise AssertionError(
                f"job {job_id} ended {m.group(1)} ({m.group(2)}) instead of running again"
            )


class RunningSubmit:
    """`python -m slurm_autosp.submit` in the background, its output read line by line."""

    def __init__(self, *overrides):
        self.proc = subprocess.Popen(
            submit_cmd(*overrides),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines = []
        self.job_id = None

    def wait_for_line(self, needle: str) -> str:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.job_id is None and (m := re.search(r"submitted job (\d+)", line)):
                self.job_id = m.group(1)
            if needle in line:
                return line
        raise AssertionError(f"{needle!r} never appeared; stderr:\n{self.proc.stderr.read()}")

    def finish(self, timeout_s: float = 600) -> str:
        out, err = self.proc.communicate(timeout=timeout_s)
        assert self.proc.returncode == 0, "".join(self.lines) + out + err
        return "".join(self.lines) + out
