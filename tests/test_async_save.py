"""Asynchronous saves: staged in node memory, persisted by a background writer process, a
checkpoint only once every file is written; never a partial one in `latest`. Under both
engines, one rank each; the writer is a real process, held mid-write with SIGSTOP."""

import dataclasses
import getpass
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from test_checkpoint_store import (  # noqa: F401
    engine,
    job_config,
    params,
    perturb,
    settings,
    state,
)

from slurm_autosp.checkpoint.async_save import BUFFER_FILE, CheckpointSaves, staging_dir_for
from slurm_autosp.checkpoint.background_write import host_writer
from slurm_autosp.checkpoint.manifest import read_manifest
from slurm_autosp.checkpoint.store import CheckpointError, CheckpointStore
from slurm_autosp.checkpoint.writer import WRITTEN, handle
from slurm_autosp.engine import build_engine
from slurm_autosp.lifecycle.lock import RunLock
from tests._dist_pool import dist_pools as dist_pools  # the session's pools


def writers_of(parents):
    """The checkpoint writer processes whose parent is one of `parents`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if b"slurm_autosp.checkpoint.writer" in cmdline and ppid in parents:
            found.append(int(entry))
    return found


def local_job(pid=None, restart=0):
    """A local job on this host, as the run's lock names it: this test's process by default."""
    return RunLock(str(pid or os.getpid()), "local", socket.gethostname(), restart)


def start(store, staging_root, run_dir, job=None):
    """A start's saves, asynchronous, staged under `staging_root`, for `job` (this process)."""
    return CheckpointSaves.start(store, True, str(staging_root), run_dir, job=job or local_job())


@pytest.fixture
def saves(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=3)
    store.root.mkdir()
    (tmp_path / "shm").mkdir()
    made = start(store, tmp_path / "shm", tmp_path)
    yield made
    made.close()


def wait_written(saves):
    while saves.writing():
        pass
    saves.commit_written(False)


def stopped_writer(saves, engine):  # noqa: F811
    """Save step 1 asynchronously, then stop (SIGSTOP) the writer it started, idle: the next
    asynchronous save stays in flight until it is continued (SIGCONT) or killed."""
    saves.save(engine, state(1, engine.name), synchronous=False)
    wait_written(saves)
    [writer] = writers_of({os.getpid()})
    os.kill(writer, signal.SIGSTOP)
    return writer


def test_an_asynchronous_save_becomes_the_latest_checkpoint_only_once_written(saves, engine):  # noqa: F811
    writer = stopped_writer(saves, engine)
    saved = params(engine)
    saves.save(engine, state(2, engine.name), synchronous=False)
    try:
        assert saves.writing()
        saves.commit_written(True)  # another rank still writing: nothing changes
        assert (saves.store.root / "latest").read_text() == "step_00000001"
        assert (saves.store.root / ".step_00000002.partial").is_dir()
    finally:
        os.kill(writer, signal.SIGCONT)
    wait_written(saves)
    assert (saves.store.root / "latest").read_text() == "step_00000002"
    checkpoint = saves.store.root / "step_00000002"
    assert set(read_manifest(checkpoint)["files"]) == {
        str(p.relative_to(checkpoint))
        for p in checkpoint.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    # the staged files freed once persisted; the buffer kept for the next save
    assert [p.name for p in saves.staging.iterdir()] == [BUFFER_FILE]
    perturb(engine)
    assert saves.store.load_latest(engine, settings(engine.name)) == state(2, engine.name)
    assert all(torch.equal(a, b) for a, b in zip(saved, params(engine), strict=True))


def test_an_asynchronous_save_writes_the_bytes_a_synchronous_one_writes(saves, engine, tmp_path):  # noqa: F811
    """The writer serialises the staged trees itself: every file the engine's format and the
    checkpoint hold is the synchronous save's, byte for byte (but the metadata of FSDP2's
    distributed checkpoint, which records the directory it was written to: staging)."""
    synchronous = CheckpointStore(tmp_path / "synchronous", rank=0, world_size=1, keep=1)
    synchronous.root.mkdir()
    synchronous.save(engine, state(1, engine.name))
    saves.save(engine, state(1, engine.name), synchronous=False)
    wait_written(saves)
    records = read_manifest(saves.store.root / "step_00000001")["files"]
    expected = read_manifest(synchronous.root / "step_00000001")["files"]
    if engine.name == "fsdp2":
        del records["engine/.metadata"], expected["engine/.metadata"]
    assert records == expected


def test_the_background_write_reads_its_host_tensors_as_a_cpu_run_does(tmp_path):
    """torch's writer picks its loader by CUDA being available and per_thread_copy_ahead > 0
    (filesystem.py, _write_files_from_queue): the default copies ahead on the current stream,
    GPU 0's on the writing thread. With none copied ahead it reads the staged host tensors
    serially on a GPU too, the loader the FSDP2 saves above run on CPU."""
    assert host_writer(tmp_path).per_thread_copy_ahead == 0


def release_later(writer, seconds):
    """Continue the held `writer` after `seconds`, from another thread (a save waits for it)."""
    release = threading.Timer(seconds, os.kill, (writer, signal.SIGCONT))
    release.start()
    return release


def test_a_synchronous_save_waits_for_the_save_being_written_and_commits_it_first(saves, engine):  # noqa: F811
    """The last step's save: nothing is short of time, and step 2's save is not thrown away."""
    writer = stopped_writer(saves, engine)
    saves.save(engine, state(2, engine.name), synchronous=False)
    assert saves.writing()
    saves.commit_written(True)
    release = release_later(writer, 1)
    try:
        saves.save(engine, state(3, engine.name), synchronous=True)
    finally:
        release.cancel()
    assert [p.name for p in saves.store.checkpoints()] == [
        "step_00000003",
        "step_00000002",
        "step_00000001",
    ]
    assert (saves.store.root / "latest").read_text() == "step_00000003"


def test_a_stop_without_time_for_the_save_being_written_abandons_it(saves, engine):  # noqa: F811
    """10 s before the kill cannot cover the stop's own save after it, with admission's margin:
    the save in flight is removed and the stop's save made at once."""
    stopped_writer(saves, engine)  # killed by the abandon, stopped or not
    saves.save(engine, state(2, engine.name), synchronous=False)
    saves.save(engine, state(3, engine.name), True, stopping=lambda: True, time_left=lambda: 10.0)
    assert not (saves.store.root / ".step_00000002.partial").exists()
    assert [p.name for p in saves.store.checkpoints()] == ["step_00000003", "step_00000001"]
    assert writers_of({os.getpid()}) == []


def test_a_new_save_waits_for_the_previous_one_and_commits_it(saves, engine):  # noqa: F811
    saves.save(engine, state(1, engine.name), synchronous=False)
    saves.save(engine, state(2, engine.name), synchronous=False)
    assert (saves.store.root / "latest").read_text() == "step_00000001"
    wait_written(saves)
    assert [p.name for p in saves.store.checkpoints()] == ["step_00000002", "step_00000001"]


def test_the_signals_slurm_sends_a_whole_process_group_leave_the_writer_writing(saves, engine):  # noqa: F811
    """USR2, TERM and INT are the rank's to act on: sent to the writer too (proctrack/pgid,
    `scancel --signal`), they kill neither it nor the save it is writing."""
    writer = stopped_writer(saves, engine)
    saves.save(engine, state(2, engine.name), synchronous=False)
    for signum in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        os.kill(writer, signum)
    os.kill(writer, signal.SIGCONT)
    wait_written(saves)
    assert (saves.store.root / "latest").read_text() == "step_00000002"
    assert writers_of({os.getpid()}) == [writer]


def test_a_stop_out_of_time_while_a_new_save_waits_for_the_previous_abandons_it(saves, engine):  # noqa: F811
    """A signal that arrives while step 3's save waits for step 2's write (held here), with no
    time left for both: step 2 is abandoned, step 3 saved synchronously, and the caller told to
    stop. (The timer only ends a wait that would otherwise last for ever.)"""
    writer = stopped_writer(saves, engine)
    saves.save(engine, state(2, engine.name), synchronous=False)
    release = release_later(writer, 20)
    try:
        assert saves.save(
            engine, state(3, engine.name), False, stopping=lambda: True, time_left=lambda: 0.0
        )
    finally:
        release.cancel()
    assert (saves.store.root / "latest").read_text() == "step_00000003"
    assert [p.name for p in saves.store.checkpoints()] == ["step_00000003", "step_00000001"]
    assert not list(saves.store.root.glob(".*.partial")) and writers_of({os.getpid()}) == []


def test_a_stop_whose_time_left_is_not_known_waits_for_the_previous_save(saves, engine):  # noqa: F811
    """The same signal where nothing says when the kill comes: step 2's write is waited for and
    committed, then step 3 saved synchronously, and the caller told to stop."""
    writer = stopped_writer(saves, engine)
    saves.save(engine, state(2, engine.name), synchronous=False)
    release = release_later(writer, 1)
    try:
        assert saves.save(engine, state(3, engine.name), False, stopping=lambda: True)
    finally:
        release.cancel()
    assert [p.name for p in saves.store.checkpoints()] == [
        "step_00000003",
        "step_00000002",
        "step_00000001",
    ]


def test_a_signal_while_the_writer_starts_leaves_it_writing(saves, engine):  # noqa: F811
    """Slurm signals every process of a job step, the writer too, also while its interpreter
    starts and imports torch (seconds on a cold shared file system): born with those signals
    blocked, it ignores them once it runs, and writes."""
    saves.save(engine, state(1, engine.name), synchronous=False)
    [writer] = writers_of({os.getpid()})
    for signum in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        os.kill(writer, signum)
    wait_written(saves)
    assert (saves.store.root / "latest").read_text() == "step_00000001"
    assert writers_of({os.getpid()}) == [writer]


@pytest.mark.slow
def test_a_writer_killed_by_a_signal_is_no_storage_error_its_rank_writes_the_save(saves, engine):  # noqa: F811
    writer = stopped_writer(saves, engine)
    saved = params(engine)
    saves.save(engine, state(2, engine.name), synchronous=False)
    os.kill(writer, signal.SIGKILL)
    wait_written(saves)
    assert (saves.store.root / "latest").read_text() == "step_00000002"
    perturb(engine)
    assert saves.store.load_latest(engine, settings(engine.name)) == state(2, engine.name)
    assert all(torch.equal(a, b) for a, b in zip(saved, params(engine), strict=True))
    saves.save(engine, state(3, engine.name), synchronous=False)  # a new writer
    wait_written(saves)
    assert (saves.store.root / "latest").read_text() == "step_00000003"


def test_a_failed_background_write_is_removed_and_stops_the_job_naming_the_file(saves, engine):  # noqa: F811
    writer = stopped_writer(saves, engine)
    saves.save(engine, state(2, engine.name), synchronous=False)
    partial = saves.store.root / ".step_00000002.partial"
    partial.rmdir()
    partial.write_text("not a directory")  # the writer cannot put a file below it
    os.kill(writer, signal.SIGCONT)
    with pytest.raises(CheckpointError, match=r"save of step 2 failed: .*\.step_00000002\.partial"):
        wait_written(saves)
    assert not partial.exists()
    assert (saves.store.root / "latest").read_text() == "step_00000001"


def test_a_request_run_again_after_its_writer_died_part_way_writes_every_file(tmp_path):
    """A writer killed while it copies a staged save out (here as soon as it has written a first
    file) leaves a record of what it wrote: the rank, running the request again, writes what is
    left, and answers every file's record, as one run would."""
    staged = tmp_path / "staged"
    (staged / "engine").mkdir(parents=True)
    expected = {}
    for i in range(4):
        data = os.urandom(8 * 2**20)
        (staged / "engine" / f"__{i}_0.distcp").write_bytes(data)
        expected[f"engine/__{i}_0.distcp"] = {
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    request = {
        "staged": str(staged),
        "partial": str(tmp_path / ".step_00000001.partial"),
        "buffer": str(tmp_path / "buffer"),
    }
    writer = subprocess.Popen(
        [sys.executable, "-m", "slurm_autosp.checkpoint.writer", str(os.getpid())],
        stdin=subprocess.PIPE,
        text=True,
    )
    writer.stdin.write(json.dumps(request) + "\n")
    writer.stdin.flush()
    deadline = time.monotonic() + 120  # only a hang fails on it
    while not (staged / WRITTEN).is_file() and time.monotonic() < deadline:
        time.sleep(0.001)
    writer.kill()
    writer.wait()
    assert handle(request)["records"] == expected
    for name, record in expected.items():
        written = (tmp_path / ".step_00000001.partial" / name).read_bytes()
        assert hashlib.sha256(written).hexdigest() == record["sha256"]


def test_a_fenced_job_stages_no_save(tmp_path, engine):  # noqa: F811
    """Once another start of the job holds the run, an asynchronous save is refused before
    anything is staged, as a synchronous one is before it begins."""
    fenced = ""
    store = CheckpointStore(tmp_path / "checkpoints", 0, 1, keep=2, fence=lambda: fenced)
    (tmp_path / "shm").mkdir()
    saves = start(store, tmp_path / "shm", tmp_path)
    try:
        saves.save(engine, state(1, engine.name), synchronous=False)
        wait_written(saves)
        fenced = "a later start trains the run now"
        with pytest.raises(CheckpointError, match="not saving step 2: a later start trains"):
            saves.save(engine, state(2, engine.name), synchronous=False)
        assert not (saves.staging / "save").exists() and not saves.writing()
        assert sorted(p.name for p in store.root.iterdir()) == ["latest", "step_00000001"]
    finally:
        saves.close()


def test_a_staging_directory_planted_by_someone_else_is_refused_and_saves_stay_synchronous(
    tmp_path, single_rank_group, caplog
):
    shm = tmp_path / "shm"
    shm.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (shm / f"slurm_autosp-{getpass.getuser()}").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="not a private directory of yours"):
        staging_dir_for(str(shm), local_job(), tmp_path, 0)
    store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=2)
    saves = start(store, shm, tmp_path)
    assert not saves.asynchronous
    assert "saving synchronously" in caplog.text


@pytest.fixture
def small_tmpfs(tmp_path):
    """A memory file system of 8 KiB, smaller than one save: a /dev/shm that fills up."""
    mounted = tmp_path / "small_shm"
    mounted.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(mounted)], check=True)
    yield mounted
    subprocess.run(["umount", str(mounted)], check=True)


def test_a_staging_file_system_that_fills_up_falls_back_to_a_synchronous_save(
    tmp_path,
    engine,  # noqa: F811
    small_tmpfs,
    caplog,
):
    """The first save too is checked against the room its staging takes (its buffer, and
    FSDP2's distributed checkpoint beside it): it is made synchronously instead, named."""
    store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=2)
    store.root.mkdir()
    saves = start(store, small_tmpfs, tmp_path)
    try:
        with caplog.at_level("WARNING"):
            saves.save(engine, state(1, engine.name), synchronous=False)
    finally:
        saves.close()
    assert "saving step 1 synchronously: the staging directory" in caplog.text
    assert (store.root / "latest").read_text() == "step_00000001"
    read_manifest(store.root / "step_00000001")
    assert not list(store.root.glob(".*.partial"))
    assert not any(p.is_file() for p in small_tmpfs.rglob("*"))


def used_inodes(path):
    info = os.statvfs(path)
    return info.f_files - info.f_ffree


def test_a_distributed_checkpoint_that_cannot_be_staged_is_saved_from_its_staged_copy(
    tmp_path,
    single_rank_group,
    caplog,
):
    """FSDP2's distributed checkpoint is written into node memory by a thread after the stall.
    Where that write fails on a staging file system whose room was checked (here it runs out of
    inodes), the step is not lost: the rank writes it from its staged copy, synchronously, and
    the next saves are synchronous."""
    fsdp2 = build_engine(job_config(3), torch.device("cpu"), 3)
    saved = params(fsdp2)
    shm = tmp_path / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(shm)], check=True)
    try:
        store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=2)
        store.root.mkdir()
        saves = start(store, shm, tmp_path)
        # inodes for the rank's directory, its buffer, the save's directory and its trees only
        room = f"remount,nr_inodes={used_inodes(shm) + 4}"
        subprocess.run(["mount", "-o", room, str(shm)], check=True)
        with caplog.at_level("WARNING"):
            saves.save(fsdp2, state(1, fsdp2.name), synchronous=False)
            wait_written(saves)
            assert not saves.asynchronous
            saves.save(fsdp2, state(2, fsdp2.name), synchronous=False)
        saves.close()
    finally:
        subprocess.run(["umount", str(shm)], check=True)
    assert "the asynchronous save of step 1 could not be staged" in caplog.text
    assert [p.name for p in store.checkpoints()] == ["step_00000002", "step_00000001"]
    assert not list(store.root.glob(".*.partial"))
    shutil.rmtree(store.root / "step_00000002")
    perturb(fsdp2)
    assert store.load_latest(fsdp2, settings(fsdp2.name)) == state(1, fsdp2.name)
    assert all(torch.equal(a, b) for a, b in zip(saved, params(fsdp2), strict=True))


@pytest.mark.slow
def test_a_first_fsdp2_save_that_staging_has_no_room_for_is_saved_synchronously(
    tmp_path, dist_pools
):
    """Two ranks on one node, their staging file system with room for their buffers but not
    for the distributed checkpoint's files beside them: the first save is checked like the
    next ones, and made synchronously, named."""
    pool = dist_pools(2)
    roomy = tmp_path / "roomy"
    roomy.mkdir()
    sizes = pool.run("async_save_cases:first_fsdp2_save", str(tmp_path / "sizing"), str(roomy))
    buffers = sum(staged for staged, _, _ in sizes)
    small = tmp_path / "small_shm"
    small.mkdir()
    room = f"size={buffers + buffers // 4 + 2**20}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", room, "tmpfs", str(small)], check=True)
    try:
        outcomes = pool.run("async_save_cases:first_fsdp2_save", str(tmp_path / "run"), str(small))
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert [checkpoints for _, checkpoints, _ in outcomes] == [["step_00000001"]] * 2
    assert "saving step 1 synchronously: the staging directory" in outcomes[0][2]


def test_what_a_killed_run_of_a_start_left_in_staging_is_freed_when_it_runs_again(
    tmp_path, single_rank_group
):
    """A local job's ranks started again (requeued) are the same start: what any rank of the
    killed run left is freed (a kill -9 ran no cleanup)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    left = staging_dir_for(str(shm), local_job(), tmp_path, 3)
    left.mkdir()
    (left / "engine.pt").write_bytes(b"x" * 1024)
    store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=2)
    saves = start(store, shm, tmp_path)
    assert saves.asynchronous and not left.exists()
    saves.close()


@pytest.mark.slow
def test_two_starts_of_one_job_on_one_node_keep_separate_buffers(tmp_path, engine):  # noqa: F811
    """Slurm may start a job again (requeued after its node was lost) while the earlier start
    still runs: each start stages in a directory of its own, and neither frees the other's."""
    shm = tmp_path / "shm"
    shm.mkdir()
    job = RunLock("4242", "slurm", socket.gethostname(), restart=0)
    earlier = CheckpointStore(tmp_path / "earlier", rank=0, world_size=1, keep=3)
    later = CheckpointStore(tmp_path / "later", rank=0, world_size=1, keep=3)
    first = start(earlier, shm, tmp_path, job)
    second = None
    try:
        writer = stopped_writer(first, engine)
        first.save(engine, state(2, engine.name), synchronous=False)  # held mid-write
        second = start(later, shm, tmp_path, dataclasses.replace(job, restart=1))
        second.save(engine, state(1, engine.name), synchronous=False)
        wait_written(second)
        assert (first.staging / BUFFER_FILE).is_file()
        assert first.staging.parent != second.staging.parent
        os.kill(writer, signal.SIGCONT)
        wait_written(first)
    finally:
        first.close()
        if second is not None:
            second.close()
    assert (earlier.root / "latest").read_text() == "step_00000002"
    assert (later.root / "latest").read_text() == "step_00000001"


def test_a_start_frees_the_staging_of_a_job_that_is_gone_and_leaves_a_live_ones(
    tmp_path, single_rank_group
):
    """Staging a killed job left on a node is freed by the next start of any job there, once
    its job is gone (here local jobs: their process has exited), never while it runs."""
    shm = tmp_path / "shm"
    shm.mkdir()
    ended = subprocess.Popen(["true"])
    ended.wait()
    running = subprocess.Popen(["sleep", "600"])
    try:
        gone = staging_dir_for(str(shm), local_job(ended.pid), tmp_path / "gone", 0)
        live = staging_dir_for(str(shm), local_job(running.pid), tmp_path / "live", 0)
        for left in (gone, live):
            left.mkdir()
            (left / BUFFER_FILE).write_bytes(b"x" * 4096)
        store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=2)
        start(store, shm, tmp_path).close()
        assert not gone.parent.exists()
        assert (live / BUFFER_FILE).is_file()
    finally:
        running.kill()
        running.wait()
