"""Two starts of one job (SLURM requeued it while the node it lost still ran it): the earlier
start, superseded, changes nothing the later one reads. It commits nothing, deletes nothing and
leaves the later start's lock; `latest` never moves back, even where a fence check races the
takeover. Real lock files and real checkpoint saves, one rank."""

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from slurm_autosp.checkpoint.state_files import StateFiles  # noqa: E402
from slurm_autosp.checkpoint.store import (  # noqa: E402
    CheckpointError,
    CheckpointStore,
    TrainerState,
)
from slurm_autosp.lifecycle.lock import (  # noqa: E402
    RunLock,
    acquire_lock,
    read_lock,
    release_lock,
    superseded,
)
from slurm_autosp.lifecycle.run_dir import RunDir  # noqa: E402

FIRST = RunLock("41", "slurm", "node1", restart=0)
SECOND = RunLock("41", "slurm", "node2", restart=1)  # SLURM_RESTART_COUNT=1: the later start


class TinyEngine:
    """The least a checkpoint saves of an engine: a name, a model, its state as one file."""

    name = "tiny"

    def __init__(self) -> None:
        self.module = nn.Linear(2, 2)

    def state_files(self) -> StateFiles:
        return StateFiles(trees={"model.pt": self.module.state_dict()})

    def load(self, path):
        self.module.load_state_dict(torch.load(path / "model.pt", weights_only=True))


def state(step):
    return TrainerState(step=step, samples_consumed=step, world_size=1, layout="dp1", engine="tiny")


def store_of(start, run_dir, keep=1):
    """A start's checkpoint store, fenced by the run's lock as launch/job.py fences it."""
    return CheckpointStore(
        RunDir(run_dir).checkpoints, 0, 1, keep=keep, fence=lambda: superseded(run_dir, start)
    )


def latest(run_dir):
    """The checkpoint the run's `latest` names ("" before any)."""
    pointer = RunDir(run_dir).checkpoints / "latest"
    return pointer.read_text() if pointer.exists() else ""


def checkpoints(run_dir):
    return sorted(p.name for p in RunDir(run_dir).checkpoints.iterdir() if p.name != "latest")


@pytest.fixture
def engine(single_rank_group):
    return TinyEngine()


def test_a_superseded_start_saves_nothing_and_leaves_the_later_starts_lock(tmp_path, engine):
    acquire_lock(tmp_path, FIRST)
    first = store_of(FIRST, tmp_path)
    first.save(engine, state(1))
    first.save(engine, state(2))
    acquire_lock(tmp_path, SECOND)  # resumes from step 2
    with pytest.raises(CheckpointError, match=r"not saving step 3: SLURM started job 41 again"):
        first.save(engine, state(3))
    release_lock(tmp_path, FIRST)  # the earlier start ends
    assert read_lock(tmp_path) == SECOND
    assert latest(tmp_path) == "step_00000002" and checkpoints(tmp_path) == ["step_00000002"]


def test_a_start_whose_lock_was_removed_saves_nothing(tmp_path, engine):
    acquire_lock(tmp_path, FIRST)
    first = store_of(FIRST, tmp_path)
    first.save(engine, state(1))
    RunDir(tmp_path).lock.unlink()  # removed by hand, or mid-takeover by another job
    with pytest.raises(CheckpointError, match=r"not saving step 2: .*job\.lock is gone"):
        first.save(engine, state(2))
    assert latest(tmp_path) == "step_00000001" and checkpoints(tmp_path) == ["step_00000001"]


def test_latest_never_moves_back_even_where_the_fence_check_raced(tmp_path, engine):
    """The later start has committed step 5. The earlier one, whose fence check raced the
    takeover (modelled by no fence at all), commits step 4, then step 5 itself: `latest`
    keeps naming the later start's step 5, which stays in place."""
    acquire_lock(tmp_path, SECOND)
    store_of(SECOND, tmp_path).save(engine, state(5))
    raced = CheckpointStore(RunDir(tmp_path).checkpoints, 0, 1, keep=1)
    with pytest.raises(CheckpointError, match=r"latest names step_00000005, not older than"):
        raced.save(engine, state(4))
    with pytest.raises(CheckpointError, match=r"latest names step_00000005, not older than"):
        raced.save(engine, state(5))
    assert latest(tmp_path) == "step_00000005"
    assert "step_00000005" in checkpoints(tmp_path)
    assert not any(name.startswith("damaged_") for name in checkpoints(tmp_path))


def test_a_takeover_landing_inside_a_commit_deletes_nothing(tmp_path, engine):
    """With checkpoint.keep=1 the earlier start's commit of step 2 deletes step 1. The later
    start claims the run (and reads `latest`: step 1, which it loads) after the earlier start's
    last check before it moves `latest`: the earlier start deletes nothing from then on."""
    acquire_lock(tmp_path, FIRST)

    def fence():
        if latest(tmp_path) == "step_00000002" and read_lock(tmp_path) == FIRST:
            acquire_lock(tmp_path, SECOND)
        return superseded(tmp_path, FIRST)

    first = CheckpointStore(RunDir(tmp_path).checkpoints, 0, 1, keep=1, fence=fence)
    first.save(engine, state(1))
    with pytest.raises(CheckpointError, match=r"step_00000002 saved, but not removing .*step_0+1"):
        first.save(engine, state(2))
    assert checkpoints(tmp_path) == ["step_00000001", "step_00000002"]
    release_lock(tmp_path, FIRST)
    assert read_lock(tmp_path) == SECOND
