"""A training job that signals its own job step at a named moment of each start: the fault
matrix's job (test_fault_matrix.py). Rank 0 sends the signal from the moment's real call site,
to every process of the job step as SLURM does (the ranks, their writers and compilers), and
records what it sent in the run's faults.jsonl for the test to time the ranks' exit.

Start i of the run (counted in the run directory) gets the i-th fault of FAULTS, an environment
variable of `moment:SIGNAL` items separated by commas, which local ranks inherit from the
submitting process. Run as `python -m fault_injection cfg=... key=value ...` with the repository
and tests/ on PYTHONPATH: the submit command, with this job type."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from local_job import job_step

import slurm_autosp.train as train_module
from slurm_autosp.checkpoint.async_save import BackgroundWriter, CheckpointSaves
from slurm_autosp.checkpoint.staging_buffer import StagingBuffer
from slurm_autosp.config import load_config
from slurm_autosp.engine.deepspeed_zero1 import ZeRO1Engine
from slurm_autosp.engine.fsdp2 import FSDP2Engine
from slurm_autosp.evaluate import Evaluator
from slurm_autosp.launch.job import TrainingJob
from slurm_autosp.launch.submission import submit

MOMENTS = (
    "compile",  # g++ compiles a kernel of the start's first step (a fresh compile cache)
    "forward",  # the second step's forward begins
    "backward",  # the second step's backward begins
    "optimizer",  # the second step's optimizer step begins
    "evaluation",  # an evaluation's second batch
    "staging",  # a save's tensors are being copied into node memory
    "writer_start",  # the writers were just spawned, still importing
    "writer_writing",  # a writer was just handed a save
    "requeue",  # a second signal, while the stop of the second step's forward requeues
    "final_save",  # the last step's save begins
)
FAULTS_ENV = "FAULTS"
FAULTS_FILE = "faults.jsonl"  # in the run directory: a line per signal sent
STARTS_FILE = "fault_starts"  # in the run directory: a line per start


@dataclass(frozen=True)
class Fault:
    moment: str
    signum: signal.Signals

    def __str__(self) -> str:
        return f"{self.moment}:{self.signum.name}"


def faults_env(faults: list[Fault]) -> str:
    return ",".join(map(str, faults))


def _faults() -> list[Fault]:
    items = [item.split(":") for item in os.environ[FAULTS_ENV].split(",")]
    return [Fault(moment, signal.Signals[name]) for moment, name in items]


def descendants(pid: int) -> set[int]:
    """Every process started by `pid`, and their own."""
    return job_step({pid}) - {pid}


class FaultyJob(TrainingJob):
    def __call__(self):
        if submitit.JobEnvironment().global_rank == 0:
            _arm(Path(self.cfg.run.dir), self.cfg.train.steps)
        return super().__call__()


def _arm(run_dir: Path, steps: int) -> None:
    """Rank 0: put this start's fault at its call site."""
    starts = run_dir / STARTS_FILE
    with open(starts, "a") as f:
        f.write(f"{os.getpid()}\n")
    start = len(starts.read_text().splitlines()) - 1
    faults = _faults()
    if start >= len(faults):
        return
    fault = faults[start]
    sent: list[float] = []

    def send() -> None:
        # ranks: the local controller's children; the job step: them and all they started
        ranks = {p for p in descendants(os.getppid()) if _parent(p) == os.getppid()}
        step = descendants(os.getppid())
        line = {
            "start": start,
            "moment": fault.moment,
            "signal": fault.signum.name,
            "sent": time.time(),
            "ranks": sorted(ranks),
        }
        with open(run_dir / FAULTS_FILE, "a") as f:
            f.write(json.dumps(line) + "\n")
        for pid in step:
            try:
                os.kill(pid, fault.signum)
            except ProcessLookupError:
                continue
        sent.append(line["sent"])

    step_in_start = [0]

    def count_steps(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            step_in_start[0] += 1
            return original(*args, **kwargs)

        return counted

    train_module.optimizer_step = count_steps(train_module.optimizer_step)

    def before(owner: Any, name: str, when: Callable[..., bool], after: bool = False) -> None:
        """Send the fault the first time `owner.name` is called with `when(*args)` true."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def faulty(*args: Any, **kwargs: Any) -> Any:
            due = not sent and when(*args, **kwargs)
            if due and not after:
                send()
            result = original(*args, **kwargs)
            if due and after:
                send()
            return result

        setattr(owner, name, faulty)

    def second_step(*_: Any, **__: Any) -> bool:
        return step_in_start[0] == 2

    def training_forward(engine: Any, **_: Any) -> bool:
        return second_step() and engine.module.training

    match fault.moment:
        case "compile":
            threading.Thread(target=_when_compiling, args=(send,), daemon=True).start()
        case "forward" | "requeue":
            for engine in (ZeRO1Engine, FSDP2Engine):
                before(engine, "__call__", training_forward)
            if fault.moment == "requeue":
                leave = train_module.requeue_and_exit

                @functools.wraps(leave)
                def signalled_again(*args: Any, **kwargs: Any) -> Any:
                    sent.clear()
                    send()
                    return leave(*args, **kwargs)

                train_module.requeue_and_exit = signalled_again
        case "backward":
            for engine in (ZeRO1Engine, FSDP2Engine):
                before(engine, "backward", second_step)
        case "optimizer":
            for engine in (ZeRO1Engine, FSDP2Engine):
                before(engine, "step", second_step)
        case "evaluation":
            batches = [0]

            def second_batch(*_: Any) -> bool:
                batches[0] += 1
                return batches[0] == 2

            before(Evaluator, "_shard", second_batch)
        case "staging":
            before(StagingBuffer, "stage", lambda *_: True)
        case "writer_start":
            before(BackgroundWriter, "__init__", lambda *_: True, after=True)
        case "writer_writing":
            before(BackgroundWriter, "_send", lambda *_: True, after=True)
        case "final_save":
            before(
                CheckpointSaves,
                "save",
                lambda saves, engine, state, synchronous, **_: state.step == steps,
            )
        case _:
            raise ValueError(f"{fault.moment}: not one of {MOMENTS}")


def _when_compiling(send: Callable[[], None]) -> None:
    """Send once this rank runs g++ on a kernel (not on inductor's probe of the CPU's vector
    instructions)."""
    while True:
        for pid in descendants(os.getpid()):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if (
                    Path(args[0].decode()).name == "g++"
                    and b"__avx_chk_kernel" not in Path(args[1].decode()).read_bytes()
                ):
                    send()
                    return
            except (OSError, IndexError, UnicodeDecodeError):
                continue
        time.sleep(0.01)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


if __name__ == "__main__":
    from fault_injection import FaultyJob as Importable  # pickled by its module's name

    sys.exit(submit(load_config(sys.argv[1:]), False, Importable))
