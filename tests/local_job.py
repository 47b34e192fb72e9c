"""A job submitted on local processes and watched while it runs: its output as it comes, its
rank processes, its checkpoints; for the tests that signal or kill a running job."""

import subprocess
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Job:
    """`cmd` (a local `submit`) training into `run_dir`, its output collected as it comes."""

    def __init__(self, cmd: list[str], run_dir: Path):
        self.folder = run_dir / "submitit"
        self.checkpoints = run_dir / "checkpoints"
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
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

    def finish(self, timeout: float = 600) -> None:
        """Wait for submit to end, and for its last line."""
        assert self.proc.wait(timeout=timeout) == 0, self.output
        self._reader.join(timeout=30)

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
