"""A job submitted on local processes and watched while it runs: its output as it comes, its
rank processes, its checkpoints; for the tests that signal or kill a running job."""

import os
import subprocess
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Job:
    """`cmd` (a local `submit`) training into `run_dir`, its output collected as it comes."""

    def __init__(self, cmd: list[str], run_dir: Path, env: dict[str, str] | None = None):
        """`env`: submit's environment (its local ranks inherit it); None: this process's."""
        self.folder = run_dir / "submitit"
        self.checkpoints = run_dir / "checkpoints"
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout: float = 600, status: int = 0) -> None:
        """Wait for submit to end with `status`, and for its last line."""
        ended = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        assert ended == status, self.output

    def ranks(self) -> set[int]:
        found = subprocess.run(
            ["pgrep", "-f", f"submitit.core._submit {self.folder}"], capture_output=True, text=True
        )
        return {int(pid) for pid in found.stdout.split()}

    def wait_for(self, what, condition, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None or condition(), f"{what}: the job ended\n{self.output}"
            assert time.monotonic() < deadline, f"{what}: timed out\n{self.output}"
            time.sleep(0.02)

    def latest(self) -> str:
        try:
            return (self.checkpoints / "latest").read_text()
        except FileNotFoundError:
            return ""


def gone(pids) -> bool:
    """Whether every one of `pids` has exited (a zombie counts as exited)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return False
        except FileNotFoundError:
            continue
    return True


def job_step(ranks) -> set[int]:
    """`ranks` and every process they started: what SLURM's signals reach in a job step
    (proctrack/cgroup signals each of them, proctrack/pgid their process group)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            parents[int(entry.name)] = int(
                (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            )
        except (OSError, ValueError, IndexError):
            continue
    found = set(ranks)
    while grown := {pid for pid, parent in parents.items() if parent in found} - found:
        found |= grown
    return found


def signal_job_step(ranks, signum) -> None:
    """Send `signum` to every process of the job step, as SLURM does."""
    for pid in job_step(ranks):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue
