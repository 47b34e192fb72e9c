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

A new save waits for the previous one, unless a stop is asked for while it waits (the ranks
agree on it every half second): then the previous one is abandoned and the new one made
synchronously, as the signal's save. A synchronous save (the preemption or time-limit
signal's, the last step's) first commits the pending save if every writer has finished, else
abandons it (removed; the synchronous save of a later step follows at once), so the signal's
deadline never covers more than one save.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import pickle
import select
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from slurm_autosp.checkpoint.background_write import BackgroundWrite
from slurm_autosp.checkpoint.manifest import FileRecord
from slurm_autosp.checkpoint.staging_buffer import StagingBuffer
from slurm_autosp.checkpoint.state_files import StateFiles
from slurm_autosp.checkpoint.store import (
    CheckpointError,
    CheckpointStore,
    EngineState,
    TrainerState,
)
from slurm_autosp.checkpoint.writer import STAGED_FILES

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.5  # how often ranks waiting for a previous save agree on a stop
# in a rank's staging directory: its buffer, kept from save to save, and one save's other files
BUFFER_FILE = "buffer"
SAVE_DIR = "save"


@dataclass(frozen=True)
class SaveFailure:
    """Why a rank's part of an asynchronous save was not written. `staging`: what a collective
    writes in the background (FSDP2's distributed checkpoint) could not be written to node
    memory, and the job goes on saving synchronously; otherwise the writer failed on storage."""

    message: str
    staging: bool = False


class BackgroundWriter:
    """This rank's writer process: one request at a time (a new save waits for the previous)."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "slurm_autosp.checkpoint.writer", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._answer: dict[str, Any] | None = None
        self.copied_bytes = 0  # of the last save: the files it copied from the staging directory
        self._sending = threading.Lock()  # a background write's thread may send the request
        self._stopped = False
        self.busy = False

    def submit(self, staged: Path, partial: Path, buffer: Path, after: Future[Any] | None) -> None:
        """Hand the writer a staged save; `after`: once this background write is done (the
        request is then sent from its thread), or, if it failed, answer with its error."""
        assert not self.busy
        self.busy, self._answer = True, None
        request = {"staged": str(staged), "partial": str(partial), "buffer": str(buffer)}
        if after is None:
            self._send(request)
        else:
            after.add_done_callback(lambda written: self._send_after(written, request))

    def _send_after(self, written: Future[Any], request: dict[str, str]) -> None:
        error = written.exception()
        if error is None:
            self._send(request)
        else:
            self._answer = {"error": f"{request['staged']}: {_last_line(error)}", "staging": True}

    def _send(self, request: dict[str, str]) -> None:
        assert self._process.stdin is not None
        with self._sending:
            if not self._stopped:
                self._process.stdin.write(json.dumps(request) + "\n")
                self._process.stdin.flush()

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

    def result(self) -> dict[str, FileRecord] | SaveFailure:
        """Wait for the answer: the files' records, or what stopped the save."""
        while not self.wait(WAIT_POLL_S):
            pass
        assert self._answer is not None
        answer, self._answer, self.busy = self._answer, None, False
        if "records" in answer:
            self.copied_bytes = answer["copied"]
            return {name: FileRecord(**r) for name, r in answer["records"].items()}
        return SaveFailure(str(answer["error"]), bool(answer.get("staging")))

    def _read(self) -> None:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        self._answer = (
            json.loads(line)
            if line
            else {"error": f"the checkpoint writer died (exit status {self._process.wait()})"}
        )

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


class CheckpointSaves:
    """Every save of a job, asynchronous where enabled; all ranks call each method together."""

    def __init__(self, store: CheckpointStore, staging: Path | None, newest_step: int):
        """`staging`: this rank's staging directory (`staging_for`); None saves synchronously.
        `newest_step`: the step of the checkpoint the job resumed from (0: none)."""
        self.store = store
        self.staging = staging
        self.newest_step = newest_step  # the step of the newest checkpoint on storage
        self._buffer = StagingBuffer(staging / BUFFER_FILE) if staging is not None else None
        self._writer: BackgroundWriter | None = None
        self._pending: PendingSave | None = None
        self._background_write: BackgroundWrite | None = None  # made at the first it needs
        self._background: Future[None] | None = None  # the pending save's, until written
        # what this rank's last written save put in node memory beside its buffer (FSDP2's
        # distributed checkpoint, until the writer copied it)
        self._staged_bytes = 0

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
            self._commit(self._pending)

    def save(
        self,
        engine: EngineState,
        state: TrainerState,
        synchronous: bool,
        stopping: Callable[[], bool] = lambda: False,
    ) -> bool:
        """Collective. `synchronous`: the save is on storage when this returns (a preemption,
        the last step), and a save still being written is abandoned first; otherwise the
        pending save is waited for and committed, then this one staged. A stop asked for
        (`stopping`, on any rank) while that wait lasts abandons the pending save and makes
        this one synchronously: returns True, and the caller stops too."""
        pending, self._pending = self._pending, None
        stopped = False
        if pending is not None and not synchronous:
            stopped = not self._previous_written(stopping)
            synchronous = stopped
        if pending is not None and synchronous:
            self._abandon(pending)
        elif pending is not None:
            self._commit(pending)
        if synchronous or self._buffer is None or not self._agree_to_stage(state):
            self._save_now(engine, state)
            return stopped
        assert self.staging is not None  # the buffer's directory
        started = time.perf_counter()
        partial, final = self.store.paths(state)
        if self.store.rank == 0:  # no rank waits for it: the writers only add files below it
            partial.mkdir(parents=True, exist_ok=True)
        distributed, failure = self._stage(engine, state)
        if not _all_ranks(not failure):
            log.warning(
                "saving step %d synchronously: %s",
                state.step,
                failure or "another rank could not stage its part",
            )
            self._buffer.close()  # node memory is short: freed, and made again at the next save
            shutil.rmtree(self.staging, ignore_errors=True)
            self.store.abandon(partial)
            self._save_now(engine, state)
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
        if distributed:  # last: its thread's planning then contends with nothing here
            if self._background_write is None:
                self._background_write = BackgroundWrite()
            self._background = self._background_write.start(
                self._buffer, distributed, self.staging / SAVE_DIR
            )
        self._writer.submit(self.staging / SAVE_DIR, partial, self._buffer.path, self._background)
        self._pending = PendingSave(partial, final, state)
        return False

    def _save_now(self, engine: EngineState, state: TrainerState) -> None:
        self.store.save(engine, state)
        self.newest_step = state.step

    def _previous_written(self, stopping: Callable[[], bool]) -> bool:
        """Collective: wait until no rank is still writing the pending save (True), or until
        any rank is asked to stop (False): a signal's deadline never covers that write."""
        assert self._writer is not None
        while True:
            written = self._writer.wait(WAIT_POLL_S)
            agreed: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(agreed, (written, stopping()))
            if any(stop for _, stop in agreed):
                return False
            if all(done for done, _ in agreed):
                return True

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
            try:
                self.staging.parent.rmdir()  # the run's, once its last rank on the node is done
            except OSError:
                pass

    def _stage(self, engine: EngineState, state: TrainerState) -> tuple[dict[str, Any], str]:
        """Stage this rank's part of the save: its tensors into the buffer, the trees naming
        their places into the staging directory. Returns the distributed state dicts staged
        (for the background write) and what stopped it (a full or failing staging file
        system), empty when it is staged."""
        assert self.staging is not None and self._buffer is not None
        save_dir = self.staging / SAVE_DIR
        try:
            shutil.rmtree(save_dir, ignore_errors=True)
            self.staging.mkdir(mode=0o700, exist_ok=True)
            save_dir.mkdir(mode=0o700)
            staged = self._buffer.stage(self.store.state_files(engine, state))
            with open(save_dir / STAGED_FILES, "wb") as f:
                pickle.dump(StateFiles(staged.trees, staged.texts), f)
        except OSError as err:
            free = shutil.disk_usage(self.staging.parent).free
            return {}, (
                f"staging in {self.staging} failed ({free / 2**20:.1f} MiB free there): "
                f"{_last_line(err)}"
            )
        return staged.distributed, ""

    def _agree_to_stage(self, state: TrainerState) -> bool:
        """Collective, the one agreement before staging: this job may still write the run
        (else CheckpointError, as a synchronous save's), and every node's staging file system
        has room for another save like the last one of each of its ranks (they share it:
        /dev/shm is one per node), beside the buffers they keep. (A buffer that must grow and
        cannot is an error of staging.)"""
        assert self.staging is not None
        fenced = self.store.fence() if self.store.rank == 0 else ""
        free = shutil.disk_usage(self.staging.parent).free
        shares: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, (socket.gethostname(), self._staged_bytes, free, fenced))
        if fenced := shares[0][3]:
            raise CheckpointError(f"not saving step {state.step}: {fenced}")
        need: dict[str, int] = {}
        room: dict[str, int] = {}
        for node, staged, node_free, _ in shares:
            need[node] = need.get(node, 0) + staged
            room[node] = node_free
        short = [node for node in need if room[node] < 1.1 * need[node]]
        if short and self.store.rank == 0:
            log.warning(
                "the staging directory %s has %.1f GiB free on %s, less than the last save of "
                "the node's ranks (%.1f GiB): saving synchronously",
                self.staging.parent,
                room[short[0]] / 2**30,
                short[0],
                need[short[0]] / 2**30,
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
        """Collective: wait for every rank's writer, then make the save a checkpoint, or, if
        a writer failed, remove it and stop the job naming what failed."""
        assert self._writer is not None
        outcome = self._writer.result()
        self._pending, self._background = None, None
        self._staged_bytes = self._writer.copied_bytes
        outcomes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
        failures = [o for o in outcomes if isinstance(o, SaveFailure)]
        if failures:
            self.store.abandon(pending.partial)
            why = "; ".join(failure.message for failure in failures)
            if all(failure.staging for failure in failures):
                log.warning(
                    "the asynchronous save of step %d could not be staged (%s): removed, and "
                    "saves are synchronous from here on",
                    pending.state.step,
                    why,
                )
                self.close()
                self.staging, self._buffer = None, None
                return
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

    @classmethod
    def start(
        cls,
        store: CheckpointStore,
        asynchronous: bool,
        staging_root: str,
        run_dir: Path,
        newest_step: int = 0,
    ) -> CheckpointSaves:
        """Collective: asynchronous saves if enabled and every rank can stage; a rank that
        cannot (its staging directory is refused) makes every rank save synchronously, warned."""
        staging, problem = None, ""
        if asynchronous:
            try:
                staging = staging_dir_for(staging_root, run_dir, store.rank)
            except CheckpointError as err:
                problem = str(err)
            else:  # what a killed job of this run left on this node (any rank's), freed now
                for left in staging.parent.iterdir():
                    shutil.rmtree(left, ignore_errors=True)
        if asynchronous and not _all_ranks(not problem):
            log.warning(
                "saving synchronously: %s", problem or "another rank cannot stage its saves"
            )
            staging = None
        if staging is not None and store.rank == 0:
            log.info("checkpoint saves: asynchronous, staged in %s", staging.parent)
        return cls(store, staging, newest_step)


def _last_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"


def _all_ranks(flag: bool) -> bool:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, flag)
    return all(gathered)


def staging_dir_for(staging_root: str, run_dir: Path, rank: int) -> Path:
    """This rank's staging directory: `<staging_root>/slurm_autosp-<user>/<run>/rank_N`, the
    user's directory made private (0700) and refused when another user owns it or it is not
    a plain directory (a link planted on a shared /dev/shm)."""
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
    run = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    (base / run).mkdir(mode=0o700, exist_ok=True)
    return base / run / f"rank_{rank:05d}"
