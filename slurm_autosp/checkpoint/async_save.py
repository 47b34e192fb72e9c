"""Asynchronous saves: training stalls only while the state is staged in node memory, and a
background writer process per rank persists it to shared storage while training goes on.

A save is staged at a step boundary: every rank copies the tensors of its part into its
staging buffer (checkpoint/staging_buffer.py: node memory under `checkpoint.staging_dir`,
/dev/shm by default, reused from save to save, so the copy runs at memory speed) and hands it
to its writer (checkpoint/writer.py), which writes each file into the checkpoint's `.partial`
directory in the engine's own format, hashing and fsyncing it. What only a collective writes
(FSDP2's distributed checkpoint) a thread of the rank writes first, from the buffer into the
staging directory (checkpoint/background_write.py); the writer starts once it is done.
The checkpoint becomes one only when every rank's writer has finished: at a later step
boundary, where the ranks agree on it anyway, rank 0 writes the manifest from the writers'
records, renames it into place and moves `latest`, as a synchronous save does. Until then
`latest` names the previous checkpoint, so a job killed at any moment (kill -9 included: the
writers die with their ranks) resumes from that one and never reads a partial save.

A new save, synchronous or not (the preemption or time-limit signal's, the last step's), first
waits for the previous one and commits it. A stop asked for while it waits (the ranks agree on
it every half second) makes the new save synchronous, the signal's save; the previous one is
then abandoned (removed; `latest` never named it) only once the time left before the kill no
longer covers the new save after it (lifecycle/save_time.py's `can_wait`; a time left not known
is waited through). A writer killed by a signal is no storage error: its rank writes that save
itself. What FSDP2's distributed checkpoint could not stage in node memory is written
synchronously from the staged copy.

Staging is each start's own: `<staging_dir>/slurm_autosp-<user>/<backend>-<job id>-<restart>/`
(the job as the run's lock names it, lifecycle/lock.py), holding a record of its job and one
directory per rank. The first rank on each node frees the staging of jobs that are gone when it
starts, never that of a live job (two starts of one job id on one node keep theirs).
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import pickle
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from slurm_autosp.checkpoint.background_write import BackgroundWrite
from slurm_autosp.checkpoint.manifest import FileRecord
from slurm_autosp.checkpoint.staging_buffer import Placement, StagingBuffer
from slurm_autosp.checkpoint.state_files import StateFiles
from slurm_autosp.checkpoint.store import (
    CheckpointError,
    CheckpointStore,
    EngineState,
    TrainerState,
)
from slurm_autosp.checkpoint.writer import PROCESS_GROUP_SIGNALS, STAGED_FILES, handle
from slurm_autosp.cluster.scheduler import Liveness
from slurm_autosp.lifecycle.lock import RunLock, holder_liveness
from slurm_autosp.lifecycle.save_time import can_wait

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.5  # how often ranks waiting for a previous save agree on a stop
# in a rank's staging directory: its buffer, kept from save to save, and one save's other files
BUFFER_FILE = "buffer"
SAVE_DIR = "save"
JOB_RECORD = "job.json"  # in a start's staging directory: the job it belongs to, and its run


@dataclass(frozen=True)
class SaveFailure:
    """Why a rank's part of an asynchronous save was not written. `staging`: what a collective
    writes in the background (FSDP2's distributed checkpoint) could not be written to node
    memory: the save is written from its staged copy, and the job goes on saving synchronously.
    Otherwise the writer failed on storage."""

    message: str
    staging: bool = False


def _start_writer() -> subprocess.Popen[str]:
    """The writer process, born with the signals Slurm sends every process of a job step
    blocked (the mask survives exec; it ignores them, then unblocks them): none kills it while
    its interpreter starts. This thread's mask is put back once it is spawned."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, PROCESS_GROUP_SIGNALS)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "slurm_autosp.checkpoint.writer", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class BackgroundWriter:
    """This rank's writer process: one request at a time (a new save waits for the previous)."""

    def __init__(self) -> None:
        self._process = _start_writer()
        self._answer: dict[str, Any] | None = None
        self._sending = threading.Lock()  # a background write's thread may send the request
        self._stopped = False
        self.busy = False

    def submit(self, request: dict[str, str], after: Future[Any] | None) -> None:
        """Hand the writer a staged save; `after`: once this background write is done (the
        request is then sent from its thread), or, if it failed, answer with its error."""
        assert not self.busy
        self.busy, self._answer = True, None
        if after is None:
            self._send(request)
        else:
            after.add_done_callback(lambda written: self._send_after(written, request))

    def _send_after(self, written: Future[Any], request: dict[str, str]) -> None:
        error = written.exception()
        if error is None:
            self._send(request)
        else:
            self._answer = _staging_failed(request["staged"], error)

    def _send(self, request: dict[str, str]) -> None:
        stdin = self._process.stdin
        assert stdin is not None
        with self._sending:
            if self._stopped:
                return
            try:
                stdin.write(json.dumps(request) + "\n")
                stdin.flush()
            except BrokenPipeError:  # it died: its exit status is the answer (`_read`)
                self._stopped = True

    def done(self) -> bool:
        """Whether the request in flight is answered, without waiting."""
        assert self._process.stdout is not None
        if self.busy and self._answer is None:
            ready, _, _ = select.select([self._process.stdout], [], [], 0)
            if ready:
                self._read()
        return self._answer is not None

    def wait(self, timeout: float) -> bool:
        """Whether the request in flight is answered, waiting up to `timeout` seconds."""
        assert self._process.stdout is not None
        if self.busy and self._answer is None:
            select.select([self._process.stdout], [], [], timeout)
        return self.done()

    def result(self) -> dict[str, Any]:
        """Wait for the answer (writer.handle's; `killed` where a signal ended the writer)."""
        while not self.wait(WAIT_POLL_S):
            pass
        assert self._answer is not None
        answer, self._answer, self.busy = self._answer, None, False
        return answer

    def _read(self) -> None:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if line:
            self._answer = json.loads(line)
            return
        status = self._process.wait()
        how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        self._answer = {"error": f"the checkpoint writer died ({how})", "killed": status < 0}

    def stop(self) -> None:
        """End the writer now, whatever it is doing (its partial save is abandoned)."""
        with self._sending:
            self._stopped = True
        self._process.kill()
        self._process.wait()


@dataclass(frozen=True)
class PendingSave:
    partial: Path
    final: Path
    state: TrainerState
    staged: StateFiles  # where its tensors lie in the buffer: written from there if need be
    since: float  # time.monotonic() when it was handed to the writer


class CheckpointSaves:
    """Every save of a job, asynchronous where enabled; all ranks call each method together."""

    def __init__(self, store: CheckpointStore, staging: Path | None, newest_step: int):
        """`staging`: this rank's staging directory (`staging_dir_for`); None saves
        synchronously. `newest_step`: the step of the checkpoint the job resumed from (0: none)."""
        self.store = store
        self.staging = staging
        self.newest_step = newest_step  # the step of the newest checkpoint on storage
        self._buffer = StagingBuffer(staging / BUFFER_FILE) if staging is not None else None
        # started now: its interpreter and torch load while training starts, not while a save
        # (or a stop) waits for it; started again at a save after it was stopped
        self._writer = BackgroundWriter() if staging is not None else None
        self._pending: PendingSave | None = None
        self._background_write: BackgroundWrite | None = None  # made at the first it needs
        self._background: Future[None] | None = None  # the pending save's, until written
        self._save_s = 0.0  # the longest write of a save on this rank: what a synchronous one takes

    @property
    def asynchronous(self) -> bool:
        return self.staging is not None

    @property
    def staged_bytes(self) -> int:
        """What this rank's last asynchronous save copied into its buffer: training's stall."""
        return self._buffer.staged_bytes if self._buffer else 0

    def writing(self) -> bool:
        """Whether this rank's part of the pending save is still being written (no wait)."""
        return self._pending is not None and self._writer is not None and not self._writer.done()

    def commit_written(self, any_rank_writing: bool) -> None:
        """Collective, at every step boundary: commit the pending save once no rank is writing
        (`any_rank_writing`: `writing` agreed across ranks). A save still pending afterwards is
        then pending on every rank, and written on none completely."""
        if self._pending is not None and not any_rank_writing:
            pending, self._pending = self._pending, None
            self._commit(pending)

    def save(
        self,
        engine: EngineState,
        state: TrainerState,
        synchronous: bool,
        stopping: Callable[[], bool] = lambda: False,
        time_left: Callable[[], float | None] = lambda: None,
    ) -> bool:
        """Collective. A save still being written is waited for and committed first. A stop
        asked for (`stopping`, on any rank) while that wait lasts makes this save synchronous
        and returns True where it was not (the caller stops too); the pending save is then
        abandoned only once the time left before the kill (`time_left`: the least any rank
        knows; None: not known) no longer covers this save after it. `synchronous`: this save
        is on storage when this returns (a stop, the last step)."""
        stopped = False
        if self._pending is not None:
            written, stopped = self._wait_for_pending(state, stopping, time_left)
            pending, self._pending = self._pending, None
            if written:
                self._commit(pending)
            else:
                self._abandon(pending)
        if self.newest_step == state.step:  # the save just committed was of this step
            return stopped and not synchronous
        if synchronous or stopped or self._buffer is None:
            self._save_now(self.store.state_files(engine, state), state)
            return stopped and not synchronous
        files = self.store.state_files(engine, state)
        placement = self._buffer.place(files)
        if not self._agree_to_stage(state, self._buffer.room_needed(placement)):
            self._save_now(files, state)
            return False
        assert self.staging is not None  # the buffer's directory
        started = time.perf_counter()
        partial, final = self.store.paths(state)
        if self.store.rank == 0:  # no rank waits for it: the writers only add files below it
            partial.mkdir(parents=True, exist_ok=True)
        staged, failure = self._stage(placement)
        if not _all_ranks(not failure):
            log.warning(
                "saving step %d synchronously: %s",
                state.step,
                failure or "another rank could not stage its part",
            )
            self._buffer.close()  # node memory is short: freed, and made again at the next save
            shutil.rmtree(self.staging, ignore_errors=True)
            self.store.abandon(partial)
            self._save_now(files, state)
            return False
        if self.store.rank == 0:
            log.info(
                "checkpoint %s staged in %.2f s (%.1f MiB on this rank); written in the background",
                final.name,
                time.perf_counter() - started,
                self.staged_bytes / 2**20,
            )
        if self._writer is None:
            self._writer = BackgroundWriter()
        if staged.distributed:  # last: its thread's planning then contends with nothing here
            if self._background_write is None:
                self._background_write = BackgroundWrite()
            self._background = self._background_write.start(
                self._buffer, staged.distributed, self.staging / SAVE_DIR
            )
        self._writer.submit(self._request(partial), self._background)
        self._pending = PendingSave(partial, final, state, staged, time.monotonic())
        return False

    def _request(self, partial: Path) -> dict[str, str]:
        """What the writer is asked to write (writer.handle)."""
        assert self.staging is not None and self._buffer is not None
        return {
            "staged": str(self.staging / SAVE_DIR),
            "partial": str(partial),
            "buffer": str(self._buffer.path),
        }

    def _save_now(self, files: StateFiles, state: TrainerState) -> None:
        started = time.monotonic()
        self.store.write(files, state)
        self._save_s = max(self._save_s, time.monotonic() - started)
        self.newest_step = state.step

    def _wait_for_pending(
        self,
        state: TrainerState,
        stopping: Callable[[], bool],
        time_left: Callable[[], float | None],
    ) -> tuple[bool, bool]:
        """Collective: wait until no rank is still writing the pending save. Returns whether
        it was written, and whether a stop was asked for meanwhile. Under a stop, the wait ends
        once the time left no longer covers a save after it: the longest this job wrote, or
        the pending one's time so far if longer."""
        assert self._writer is not None and self._pending is not None
        told = False
        while True:
            written = self._writer.wait(WAIT_POLL_S)
            save_s = max(self._save_s, time.monotonic() - self._pending.since)
            agreed = _all_gather((written, stopping(), time_left(), save_s))
            stop = any(asked for _, asked, _, _ in agreed)
            if all(done for done, _, _, _ in agreed):
                return True, stop
            left = min((t for _, _, t, _ in agreed if t is not None), default=None)
            if stop and not can_wait(left, max(s for _, _, _, s in agreed)):
                return False, True
            if not told and self.store.rank == 0:
                log.info(
                    "the save of step %d waits for the asynchronous save of step %d, still "
                    "being written",
                    state.step,
                    self._pending.state.step,
                )
                told = True

    def close(self) -> None:
        """This rank only (also on an error path): stop the writer; a save it had not
        finished is abandoned (its `.partial` is removed when the run next starts)."""
        if self._writer is not None:
            self._writer.stop()
            self._writer = None
        self._pending, self._background = None, None
        if self._background_write is not None:
            self._background_write.close()
            self._background_write = None
        if self._buffer is not None:
            self._buffer.close()
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            _remove_if_unused(self.staging.parent)  # this start's, once its last rank here is done

    def _stage(self, placement: Placement) -> tuple[StateFiles, str]:
        """Stage this rank's part of the save: its tensors into the buffer, the trees naming
        their places into the staging directory. Returns the staged files (the distributed
        state dicts for the background write) and what stopped it (a full or failing staging
        file system), empty when it is staged."""
        assert self.staging is not None and self._buffer is not None
        save_dir = self.staging / SAVE_DIR
        try:
            shutil.rmtree(save_dir, ignore_errors=True)
            self.staging.mkdir(mode=0o700, exist_ok=True)
            save_dir.mkdir(mode=0o700)
            staged = self._buffer.stage(placement)
            with open(save_dir / STAGED_FILES, "wb") as f:
                pickle.dump(StateFiles(staged.trees, staged.texts), f)
        except OSError as err:
            free = shutil.disk_usage(self.staging.parent).free
            return StateFiles(), (
                f"staging in {self.staging} failed ({free / 2**20:.1f} MiB free there): "
                f"{_last_line(err)}"
            )
        return staged, ""

    def _agree_to_stage(self, state: TrainerState, need: int) -> bool:
        """Collective, the one agreement before staging: this job may still write the run
        (else CheckpointError, as a synchronous save's), and every node's staging file system
        has room for what its ranks' saves add to node memory (`need`, this rank's: they share
        it, /dev/shm is one per node), the first save's included."""
        assert self.staging is not None
        fenced = self.store.fence() if self.store.rank == 0 else ""
        free = shutil.disk_usage(self.staging.parent).free
        shares = _all_gather((socket.gethostname(), need, free, fenced))
        if fenced := shares[0][3]:
            raise CheckpointError(f"not saving step {state.step}: {fenced}")
        needed: dict[str, int] = {}
        room: dict[str, int] = {}
        for node, rank_need, node_free, _ in shares:
            needed[node] = needed.get(node, 0) + rank_need
            room[node] = node_free
        short = [node for node in needed if room[node] < 1.1 * needed[node]]
        if short and self.store.rank == 0:
            log.warning(
                "saving step %d synchronously: the staging directory %s has %.1f GiB free on "
                "%s, less than what the node's ranks would stage for it (%.1f GiB)",
                state.step,
                self.staging.parent,
                room[short[0]] / 2**30,
                short[0],
                needed[short[0]] / 2**30,
            )
        return not short

    def _abandon(self, pending: PendingSave) -> None:
        log.info("abandoning the asynchronous save of step %d, not yet written", pending.state.step)
        assert self._writer is not None
        if self._background is not None:  # it writes into node memory: let it end, failed or not
            wait_for([self._background])
            self._background = None
        self._writer.stop()
        self._writer = None
        dist.barrier()  # no writer adds a file to the directory removed next
        self.store.abandon(pending.partial)

    def _commit(self, pending: PendingSave) -> None:
        """Collective: wait for every rank's writer, then make the save a checkpoint. A rank
        whose writer a signal killed writes its part itself; a save whose distributed
        checkpoint could not be staged in node memory is written from its staged copy, and
        saves are synchronous from there on; a writer that failed on storage removes the save
        and stops the job, naming what failed."""
        assert self._writer is not None and self.staging is not None
        answer = self._writer.result()
        if answer.get("killed"):
            answer = self._write_here(pending, str(answer["error"]))
        self._background = None
        self._save_s = max(self._save_s, float(answer.get("seconds", 0.0)))
        outcomes = _all_gather(_outcome(answer))
        shutil.rmtree(self.staging / SAVE_DIR, ignore_errors=True)  # the writer's records
        failures = [o for o in outcomes if isinstance(o, SaveFailure)]
        if failures:
            why = "; ".join(failure.message for failure in failures)
            if all(failure.staging for failure in failures):
                assert self._buffer is not None
                log.warning(
                    "the asynchronous save of step %d could not be staged (%s): saved "
                    "synchronously from its staged copy, and saves are synchronous from here on",
                    pending.state.step,
                    why,
                )
                self._save_now(self._buffer.restore(pending.staged), pending.state)
                self.close()
                self.staging, self._buffer = None, None
                return
            self.store.abandon(pending.partial)
            raise CheckpointError(
                f"the asynchronous save of step {pending.state.step} failed: {why}. "
                "It was removed; the previous checkpoint is untouched. Fix the storage and submit "
                "again (or set checkpoint.async_save=false)"
            )
        records: dict[str, FileRecord] = {}
        for share in outcomes:
            records.update(share)
        self.store.finish(pending.partial, pending.final, records, pending.state)
        self.newest_step = pending.state.step

    def _write_here(self, pending: PendingSave, why: str) -> dict[str, Any]:
        """This rank's writer was killed by a signal, not by its storage: the rank writes its
        part of the staged save itself, now (a new writer starts at the next save)."""
        assert self._writer is not None
        log.warning(
            "rank %d: %s; writing its part of step %d's save itself",
            self.store.rank,
            why,
            pending.state.step,
        )
        self._writer.stop()
        self._writer = None
        request = self._request(pending.partial)
        if self._background is not None:  # its files must all be staged first
            wait_for([self._background])
            if (error := self._background.exception()) is not None:
                return _staging_failed(request["staged"], error)
        return handle(request)

    @classmethod
    def start(
        cls,
        store: CheckpointStore,
        asynchronous: bool,
        staging_root: str,
        run_dir: Path,
        job: RunLock,
        newest_step: int = 0,
    ) -> CheckpointSaves:
        """Collective: asynchronous saves if enabled and every rank can stage; a rank that
        cannot (its staging directory is refused) makes every rank save synchronously, warned.
        `job`: the start staging belongs to. What an earlier run of this same start left (a
        local requeue's) is freed, and the first rank on each node sweeps the staging of jobs
        that are gone."""
        staging, problem = None, ""
        if not asynchronous:
            return cls(store, staging, newest_step)
        try:
            staging = staging_dir_for(staging_root, job, run_dir, store.rank)
        except CheckpointError as err:
            problem = str(err)
        else:  # what a killed run of this start left on this node (any rank's), freed now
            for left in staging.parent.iterdir():
                if left.name != JOB_RECORD:
                    shutil.rmtree(left, ignore_errors=True)
        host = socket.gethostname()
        shares = _all_gather((host, problem))
        if not all(not p for _, p in shares):
            log.warning(
                "saving synchronously: %s", problem or "another rank cannot stage its saves"
            )
            return cls(store, None, newest_step)
        assert staging is not None
        if [h for h, _ in shares].index(host) == store.rank:
            sweep_staging(staging.parent.parent, job)
        if store.rank == 0:
            log.info("checkpoint saves: asynchronous, staged in %s", staging.parent)
        return cls(store, staging, newest_step)


def _outcome(answer: dict[str, Any]) -> dict[str, FileRecord] | SaveFailure:
    """A writer's answer: the files' records, or what stopped the save."""
    if "records" in answer:
        return {name: FileRecord(**r) for name, r in answer["records"].items()}
    return SaveFailure(str(answer["error"]), bool(answer.get("staging")))


def _staging_failed(staged: str, error: BaseException) -> dict[str, Any]:
    return {"error": f"{staged}: {_last_line(error)}", "staging": True}


def _last_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"


def _all_gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _all_ranks(flag: bool) -> bool:
    return all(_all_gather(flag))


def staging_dir_for(staging_root: str, job: RunLock, run_dir: Path, rank: int) -> Path:
    """This rank's staging directory: `<staging_root>/slurm_autosp-<user>/<backend>-<job
    id>-<restart>/rank_N`, the start's directory recording its job and run (JOB_RECORD). The
    user's directory is made private (0700) and refused when another user owns it or it is
    not a plain directory (a link planted on a shared /dev/shm)."""
    base = Path(staging_root) / f"slurm_autosp-{getpass.getuser()}"
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        info = base.lstat()
    except OSError as err:
        raise CheckpointError(
            f"checkpoint.staging_dir={staging_root}: cannot make {base} ({err.strerror or err}); "
            "set checkpoint.staging_dir to a memory-backed directory you can write, or "
            "checkpoint.async_save=false"
        ) from err
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise CheckpointError(
            f"checkpoint.staging_dir={staging_root}: {base} is not a private directory of yours "
            f"(owner uid {info.st_uid}, mode {stat.filemode(info.st_mode)}); remove it, or set "
            "checkpoint.staging_dir elsewhere, or checkpoint.async_save=false"
        )
    start = base / f"{job.backend}-{job.job_id}-{job.restart}"
    start.mkdir(mode=0o700, exist_ok=True)
    record = start / f".{JOB_RECORD}.{uuid.uuid4().hex}"  # the node's other ranks write theirs
    record.write_text(json.dumps({"job": asdict(job), "run": str(run_dir)}))
    os.replace(record, start / JOB_RECORD)
    return start / f"rank_{rank:05d}"


def sweep_staging(base: Path, job: RunLock) -> None:
    """Free the staging of every job that is gone (the controller no longer runs it; a local
    job's process is dead), never a live job's or one that cannot be checked. Another start of
    `job` itself is live: this one runs."""
    for start in base.iterdir():
        try:
            recorded = json.loads((start / JOB_RECORD).read_text())
            holder = RunLock(**recorded["job"])
        except (OSError, ValueError, TypeError, KeyError):
            continue  # being made, or not ours to judge
        if holder.backend == "local" and not holder.job_id.isdigit():
            continue  # no process id (a test's job): nothing to check
        if holder.same_holder(job) or holder_liveness(holder)[0] is not Liveness.gone:
            continue
        log.info(
            "freeing %s: the staging of %s (run %s), which has ended",
            start,
            holder.describe(),
            recorded["run"],
        )
        shutil.rmtree(start, ignore_errors=True)


def _remove_if_unused(start: Path) -> None:
    """Remove a start's staging directory once no rank's directory is left in it."""
    try:
        if all(p.name == JOB_RECORD for p in start.iterdir()):
            (start / JOB_RECORD).unlink(missing_ok=True)
            start.rmdir()
    except OSError:
        pass
