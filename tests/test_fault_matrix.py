"""The fault matrix: a stop signal at each moment of a job (fault_injection.MOMENTS) x {USR2,
SIGTERM then SIGKILL after a grace} x {ZeRO-1, FSDP2}, end to end on local processes, the signal
sent to every process of the job step as SLURM sends it.

One run per signal and engine: its start i is signalled at moment i, stops, saves and requeues
(or, past the requeues a local job has, is submitted again); the next start resumes and meets
the next moment; the last start is signalled in the last step's save. Every rank of every start exits within the grace (SIGKILL would follow SIGTERM
then, and the run would fail), every start resumes from the checkpoint the previous one saved
at its stop, and the run ends with the uninterrupted run's losses and weights, bit for bit.
Each cell's exit time is printed as a table row (docs/preemption.md holds a measured table)."""

import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_injection import FAULTS_ENV, FAULTS_FILE, MOMENTS, Fault, faults_env
from local_job import REPO, Job, gone
from reference_run import assert_same_weights, hf_weights, prepared_dataset, tensorboard_losses

GRACE_S = 60.0  # SIGTERM to SIGKILL; also the USR2 cells' bound, as cluster.signal_delay_s
STEPS = 14
# a local job starts at most 6 times (lifecycle/requeue.py): the run is submitted again, as a
# user would, until its last start ends it
SUBMISSIONS = 3
ENGINES = {"ZeRO-1": "parallel.zero_stage=1", "FSDP2": "parallel.zero_stage=3"}


def overrides(root: Path, name: str, engine: str) -> list[str]:
    held_out = prepared_dataset(root / "held_out", [256 * 16 + 1])
    return [
        "cfg=configs/tiny_cpu.yaml",
        "cluster.backend=local",
        f"cluster.signal_delay_s={GRACE_S:.0f}",
        "cluster.stop_at=layer",
        "cluster.max_requeues=20",  # above the 5 a local job has
        f"run.output_root={root}",
        f"run.name={name}",
        f"train.steps={STEPS}",
        "train.log_every=1",
        "train.start_check=false",
        f"data.eval_path={held_out}",
        "train.eval_every=2",
        "train.eval_samples=16",
        "checkpoint.every_steps=2",
        "checkpoint.async_save=true",
        f"compile.cache_dir={root / 'compile_cache'}",
        ENGINES[engine],
    ]


@dataclass
class Cell:
    start: int
    moment: str
    signal: str
    sent: float
    exited_s: float | None = None
    killed: bool = False


class Watch:
    """Times each signalled start's ranks to their exit; SIGKILLs those a SIGTERM left alive
    past the grace, as SLURM would."""

    def __init__(self, run_dir: Path):
        self.faults = run_dir / FAULTS_FILE
        self.cells: dict[int, Cell] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def close(self) -> list[Cell]:
        self._done.set()
        self._thread.join(timeout=GRACE_S + 30)
        return [self.cells[start] for start in sorted(self.cells)]

    def _watch(self) -> None:
        timing: dict[int, list[int]] = {}
        while not (self._done.is_set() and not timing):
            for line in self._lines():
                if line["start"] not in self.cells:  # a start's first signal is its cell's
                    self.cells[line["start"]] = Cell(
                        line["start"], line["moment"], line["signal"], line["sent"]
                    )
                    timing[line["start"]] = line["ranks"]
            for start, ranks in list(timing.items()):
                cell = self.cells[start]
                waited = time.time() - cell.sent
                if gone(ranks):
                    cell.exited_s = waited
                    del timing[start]
                elif cell.signal == "SIGTERM" and waited > GRACE_S:
                    for pid in ranks:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            continue
                    cell.killed = True
            time.sleep(0.02)

    def _lines(self) -> list[dict]:
        try:
            return [json.loads(line) for line in self.faults.read_text().splitlines()]
        except (FileNotFoundError, ValueError):
            return []


def rank0_log(run_dir: Path, output: str) -> str:
    """Rank 0's log of every start, in order: each submission's job, and its starts."""
    jobs = re.findall(r"submitted job (\d+)", output)
    return "".join((run_dir / "submitit" / f"{job}_0_log.out").read_text() for job in jobs)


def reference_run(root: Path, engine: str) -> Path:
    """The uninterrupted run of `engine`, with the same config."""
    cmd = [sys.executable, "-m", "slurm_autosp.submit", *overrides(root, engine, engine)]
    Job(cmd, root / engine).finish()
    return root / engine


# one fixture, so one xdist group (conftest.py), per engine: the two engines' runs share the
# two workers instead of queueing on one
@pytest.fixture(scope="module")
def zero1_reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory.mktemp("references"), "ZeRO-1")


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory.mktemp("references"), "FSDP2")


SIGNALS = pytest.mark.parametrize("signum", [signal.SIGUSR2, signal.SIGTERM], ids=["USR2", "TERM"])


@pytest.mark.slow
@SIGNALS
def test_a_signal_at_each_moment_of_a_zero1_job_stops_it_in_time_and_loses_nothing(
    zero1_reference, signum, tmp_path
):
    run_matrix("ZeRO-1", zero1_reference, signum, tmp_path)


@pytest.mark.slow
@SIGNALS
def test_a_signal_at_each_moment_of_an_fsdp2_job_stops_it_in_time_and_loses_nothing(
    fsdp2_reference, signum, tmp_path
):
    run_matrix("FSDP2", fsdp2_reference, signum, tmp_path)


def run_matrix(engine: str, reference: Path, signum: signal.Signals, tmp_path: Path) -> None:
    """`engine`'s run signalled at each moment; every cell checked against `reference`."""
    faults = [Fault(moment, signum) for moment in MOMENTS]
    env = dict(os.environ, **{FAULTS_ENV: faults_env(faults)})
    paths = [str(REPO), str(REPO / "tests"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))  # the ranks unpickle FaultyJob
    cmd = [sys.executable, "-m", "fault_injection", *overrides(tmp_path, "run", engine)]
    watch = Watch(tmp_path / "run")
    output = ""
    try:
        for _ in range(SUBMISSIONS):
            job = Job(cmd, tmp_path / "run", env)
            ended = job.proc.wait(timeout=900)
            job.finish(timeout=30, status=ended)
            output += job.output
            if ended == 0:
                break
            assert "submit the same run again to resume" in job.output, output
    finally:
        cells = watch.close()
    for cell in cells:
        exited = "killed" if cell.killed or cell.exited_s is None else f"{cell.exited_s:.2f} s"
        print(f"| {cell.moment} | {engine} | {cell.signal} | {exited} |")

    assert [c.moment for c in cells] == list(MOMENTS), output
    assert all(c.signal == signum.name for c in cells)
    late = [c for c in cells if c.killed or c.exited_s is None or c.exited_s > GRACE_S]
    assert not late, f"ranks not out within {GRACE_S} s: {late}\n{output}"

    # every stop saved what the next start resumed from: no good checkpoint is lost
    log = rank0_log(tmp_path / "run", output)
    stops = [int(n) for n in re.findall(rf"stopping at step (\d+) on {signum.name}", log)]
    assert len(stops) == len(MOMENTS) - 1, log  # the last start ends the run
    resumes = [int(n) for n in re.findall(r"resumed from \S+ at step (\d+)", log)]
    assert resumes == [n for n in stops if n > 0], log
    assert stops == sorted(stops), log
    # an evaluation stops after its batch in flight; a compile under way finishes, no error
    assert re.search(r"evaluation stopped after 2 of \d+ batches", log), log
    # the first submission's end alone: its ranks' requeue limit (a rank still leaving when
    # the other has left gets SIGINT from submitit's local controller)
    failures = re.findall(r"failed: (.*)", log)
    assert any("after 5 requeues: submitit's local controller" in f for f in failures), log
    assert all("after 5 requeues" in f or f == "KeyboardInterrupt: " for f in failures), log

    assert tensorboard_losses(tmp_path / "run") == tensorboard_losses(reference)
    assert [s for s, _ in tensorboard_losses(tmp_path / "run")] == list(range(1, STEPS + 1))
    assert_same_weights(hf_weights(tmp_path / "run"), hf_weights(reference))
