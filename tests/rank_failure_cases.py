"""What each rank of tests/test_rank_failure.py runs: the real job (TrainingJob, or the probe's
ProbeJob) on local processes, as submitit's local executor starts it, over a real gloo group,
with one rank's error injected at a real call site of one collective region. The failing
rank's function is replaced in that rank's process only, before the job starts; the thing under
test is what the other ranks do about it."""

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import slurm_autosp.cluster.placement as placement
import slurm_autosp.probe.steps as probe_steps
import slurm_autosp.train as train
import slurm_autosp.verify.start_check as start_check
from slurm_autosp.checkpoint.async_save import StagingBuffer
from slurm_autosp.cluster.rank_failure import FailureWatch
from slurm_autosp.config import load_config
from slurm_autosp.launch.job import LockClaim, TrainingJob
from slurm_autosp.probe.probe_job import ProbeJob, probe_config

REPO = Path(__file__).resolve().parents[1]
FAILING_RANK = 1
ERROR = f"injected on rank {FAILING_RANK}"
FAULT_AT = "fault_at"  # the failing rank writes the time it raised here
WORLD_SIZE = 2
GIVE_UP_S = 180  # a case's ranks still running this long after they start are killed

# compiled SP steps only where the region needs them: the start check compares SP steps
QUICK = ("parallel.sp_size=1", "compile.enabled=false")


@dataclass(frozen=True)
class Case:
    overrides: tuple[str, ...]
    owner: object  # the module or class whose attribute the failing rank replaces
    name: str
    error: Callable[[], BaseException]
    nodes: int = 1
    probe: bool = False


CASES = {
    # the probe's rank runs out of memory in step 1 while the other waits in the step's reduction
    "probe_out_of_memory": Case(
        (*QUICK, "probe.steps=3"),
        probe_steps,
        "optimizer_step",
        lambda: torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate 20.00 GiB ({ERROR})"
        ),
        probe=True,
    ),
    # node 1's first rank cannot run its GPU tool; node 0's waits in the gather of the reports
    "topology_detection": Case(
        # two nodes: local processes, described as the Slurm job they stand for
        (*QUICK, "cluster.backend=slurm", "cluster.nodes=2", "cluster.tasks_per_node=1"),
        placement,
        "detect_node_topology",
        lambda: RuntimeError(f"nvidia-smi topo -m exited with status 255 ({ERROR})"),
        nodes=2,
    ),
    "model_build": Case(
        QUICK,
        train,
        "build_engine",
        lambda: RuntimeError(f"cannot build the model ({ERROR})"),
    ),
    "data_open": Case(
        QUICK,
        train,
        "build_source",
        lambda: FileNotFoundError(f"no such token file ({ERROR})"),
    ),
    "start_check": Case(
        ("parallel.sp_size=2", "compile.enabled=true", "train.start_check=true"),
        start_check,
        "compare_sp_step",
        lambda: RuntimeError(f"the shrunk model did not compile ({ERROR})"),
    ),
    # an asynchronous save's staging fails on one rank (not an OSError, which the ranks already
    # agree on by saving synchronously) while the other waits in the staging's agreement
    "save_staging": Case(
        (*QUICK, "checkpoint.async_save=true", "checkpoint.every_steps=1", "train.steps=3"),
        StagingBuffer,
        "stage",
        lambda: RuntimeError(f"staging the save failed ({ERROR})"),
    ),
}


def run_rank(case_name: str, rank: int, root: str, port: int) -> None:
    """One rank of the case's job, its output into root/rank_R.log."""
    case = CASES[case_name]
    log = os.open(Path(root) / f"rank_{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    per_node = WORLD_SIZE // case.nodes
    os.environ.update(
        SUBMITIT_EXECUTOR="local",
        SUBMITIT_FOLDER=str(Path(root) / "submitit"),
        SUBMITIT_LOCAL_JOB_ID=f"rank_failure_{case_name}",
        SUBMITIT_LOCAL_NTASKS=str(WORLD_SIZE),
        SUBMITIT_LOCAL_JOB_NUM_NODES=str(case.nodes),
        SUBMITIT_LOCAL_NODEID=str(rank // per_node),
        SUBMITIT_LOCAL_GLOBALID=str(rank),
        SUBMITIT_LOCAL_LOCALID=str(rank % per_node),
        MASTER_PORT=str(port),
    )
    cfg = load_config(
        [
            f"cfg={REPO / 'configs' / 'tiny_cpu.yaml'}",
            "cluster.backend=local",
            f"run.output_root={root}",
            f"checkpoint.staging_dir={root}",
            # the old behaviour's bound: a rank left waiting ends here, past the tests' 60 s
            "cluster.collective_timeout_min=1.5",
            "trace.tensorboard=false",
            *case.overrides,
        ]
    )
    if rank == FAILING_RANK:
        _inject(case, Path(root) / FAULT_AT)
    first_start = LockClaim(record_config=True)  # as `run` starts a job: rank 0 makes the run
    job = ProbeJob(probe_config(cfg), first_start) if case.probe else TrainingJob(cfg, first_start)
    job()


def _inject(case: Case, fault_at: Path) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        fault_at.write_text(str(time.time()))
        raise case.error()

    setattr(case.owner, case.name, fail)


def watch_rank(role: str, rank: int, root: str, port: int) -> None:
    """A rank of the watch's own cases, with the watch alone over a real gloo group: it
    `waits` in an all-reduce; `fails` (publishes its error, then stays in the group, as an NCCL
    rank's exit leaves its peers' collective waiting); or `vanishes` (holds the store, then
    stops, as a host that is powered off answers nothing)."""
    log = os.open(Path(root) / f"rank_{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, force=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=90))
    watch = FailureWatch()
    watch.start(rank, WORLD_SIZE)
    if role == "waits":
        dist.all_reduce(torch.ones(1))
    elif role == "fails":
        Path(root, FAULT_AT).write_text(str(time.time()))
        watch.failed(RuntimeError(f"the step failed ({ERROR})"))
        time.sleep(GIVE_UP_S)
    else:
        Path(root, FAULT_AT).write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
