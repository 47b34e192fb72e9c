"""Asynchronous saves: staged in node memory, persisted by a background writer process, a
checkpoint only once every file is written; never a partial one in `latest`. Under both
engines, one rank each; the writer is a real process, held mid-write with SIGSTOP."""

import getpass
import os
import signal
import subprocess
import threading

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
from slurm_autosp.engine import build_engine


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


@pytest.fixture
def saves(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=3)
    store.root.mkdir()
    (tmp_path / "shm").mkdir()
    made = CheckpointSaves.start(store, True, str(tmp_path / "shm"), tmp_path)
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


def test_a_synchronous_save_abandons_a_save_still_being_written(saves, engine):  # noqa: F811
    stopped_writer(saves, engine)  # killed by the abandon, stopped or not
    saves.save(engine, state(2, engine.name), synchronous=False)
    assert saves.writing()
    saves.commit_written(True)
    saves.save(engine, state(3, engine.name), synchronous=True)
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


def test_a_stop_while_a_new_save_waits_for_the_previous_abandons_it_and_saves_now(saves, engine):  # noqa: F811
    """A signal that arrives while step 3's save waits for step 2's write (held here) does not
    wait for it: step 2 is abandoned, step 3 saved synchronously, and the caller told to stop.
    (The timer only ends a wait that would otherwise last for ever.)"""
    writer = stopped_writer(saves, engine)
    saves.save(engine, state(2, engine.name), synchronous=False)
    release = threading.Timer(20, os.kill, (writer, signal.SIGCONT))
    release.start()
    try:
        assert saves.save(engine, state(3, engine.name), False, stopping=lambda: True)
    finally:
        release.cancel()
    assert (saves.store.root / "latest").read_text() == "step_00000003"
    assert [p.name for p in saves.store.checkpoints()] == ["step_00000003", "step_00000001"]
    assert not list(saves.store.root.glob(".*.partial")) and writers_of({os.getpid()}) == []


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


def test_a_fenced_job_stages_no_save(tmp_path, engine):  # noqa: F811
    """Once another start of the job holds the run, an asynchronous save is refused before
    anything is staged, as a synchronous one is before it begins."""
    fenced = ""
    store = CheckpointStore(tmp_path / "checkpoints", 0, 1, keep=2, fence=lambda: fenced)
    (tmp_path / "shm").mkdir()
    saves = CheckpointSaves.start(store, True, str(tmp_path / "shm"), tmp_path)
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
        staging_dir_for(str(shm), tmp_path, 0)
    store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=2)
    saves = CheckpointSaves.start(store, True, str(shm), tmp_path)
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
    """The first save is staged with no earlier size to check against: a full /dev/shm stops it
    (no room for the buffer, or FSDP2's distributed checkpoint half-way), and the save is made
    synchronously instead, named."""
    store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=2)
    store.root.mkdir()
    saves = CheckpointSaves.start(store, True, str(small_tmpfs), tmp_path)
    try:
        with caplog.at_level("WARNING"):
            saves.save(engine, state(1, engine.name), synchronous=False)
    finally:
        saves.close()
    assert f"saving step 1 synchronously: staging in {saves.staging} failed (" in caplog.text
    assert (store.root / "latest").read_text() == "step_00000001"
    read_manifest(store.root / "step_00000001")
    assert not list(store.root.glob(".*.partial"))
    assert not any(p.is_file() for p in small_tmpfs.rglob("*"))


def test_a_distributed_checkpoint_that_cannot_be_staged_leaves_saves_synchronous(
    tmp_path,
    single_rank_group,
    caplog,
):
    """FSDP2's distributed checkpoint is written into node memory by a thread after the stall:
    a staging file system with room for the buffer but not for those files fails that write.
    The save is removed, named, and the next one is made synchronously; nothing else is lost."""
    fsdp2 = build_engine(job_config(3), torch.device("cpu"), 3)
    probe = CheckpointStore(tmp_path / "probe", rank=0, world_size=1, keep=1)
    probe.root.mkdir()
    (tmp_path / "shm").mkdir()
    sizing = CheckpointSaves.start(probe, True, str(tmp_path / "shm"), tmp_path)
    sizing.save(fsdp2, state(1, fsdp2.name), synchronous=False)
    buffer_bytes = sizing.staged_bytes
    sizing.close()
    small = tmp_path / "small_shm"
    small.mkdir()
    room = f"size={buffer_bytes + buffer_bytes // 4 + 2**20}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", room, "tmpfs", str(small)], check=True)
    try:
        store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=2)
        store.root.mkdir()
        saves = CheckpointSaves.start(store, True, str(small), tmp_path)
        with caplog.at_level("WARNING"):
            saves.save(fsdp2, state(1, fsdp2.name), synchronous=False)
            wait_written(saves)
            assert not saves.asynchronous
            saves.save(fsdp2, state(2, fsdp2.name), synchronous=False)
        saves.close()
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert "the asynchronous save of step 1 could not be staged" in caplog.text
    assert [p.name for p in store.checkpoints()] == ["step_00000002"]
    assert not list(store.root.glob(".*.partial"))


def test_what_a_killed_job_left_in_staging_is_freed_when_the_run_starts(
    tmp_path, single_rank_group
):
    """Any rank's staged files of this run (another layout, a rank that never comes back),
    not only this rank's: a kill -9 ran no cleanup."""
    shm = tmp_path / "shm"
    shm.mkdir()
    left = staging_dir_for(str(shm), tmp_path, 3)
    left.mkdir()
    (left / "engine.pt").write_bytes(b"x" * 1024)
    store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=2)
    saves = CheckpointSaves.start(store, True, str(shm), tmp_path)
    assert saves.asynchronous and not left.exists()
