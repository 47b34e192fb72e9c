"""A pool of persistent worker processes sharing one gloo process group, for multi-rank tests.

Starting processes, a process group and Dynamo/inductor for every test case would cost more
than the cases themselves. The pool starts N spawned workers once; each test sends a function
by qualified name ("module:function") and picklable arguments, and gets every rank's return
value, or the first failing rank's exception with its rank and traceback.
"""

import importlib
import io
import multiprocessing as mp
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

_COLLECTIVE_TIMEOUT = timedelta(seconds=180)


class RankError(RuntimeError):
    """A test function failed on a rank; carries that rank's traceback."""


def _dumps(value: Any) -> bytes:
    """Serialise with torch.save, so tensors travel by value, not by shared-memory handles."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _resolve(qualified_name: str) -> Callable[..., Any]:
    module_name, _, attribute = qualified_name.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def _worker(rank: int, world_size: int, init_file: str, cache_dir: str, conn: Connection) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_COMPILE_THREADS="1"
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # One worker compiles every test's models (several families, policies, tilings, lengths) with
    # the same layer code objects; a training job compiles one. compile_model makes hitting the
    # limit an error (never a silent eager fallback), so give the shared workers room.
    torch._dynamo.config.recompile_limit = 64
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=_COLLECTIVE_TIMEOUT,
    )
    while (message := conn.recv()) is not None:
        name, payload = message
        try:
            args, kwargs = _loads(payload)
            conn.send(("ok", _dumps(_resolve(name)(*args, **kwargs))))
        except Exception as error:  # noqa: BLE001 - every failure goes back to the test
            conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class DistPool:
    """N persistent ranks in one gloo process group; `run` executes a function on all of them."""

    def __init__(self, world_size: int, cache_dir: str, reply_timeout_s: float = 600.0) -> None:
        self.world_size = world_size
        self.reply_timeout_s = reply_timeout_s
        self.broken = False
        context = mp.get_context("spawn")
        self._init_dir = tempfile.mkdtemp(prefix="dist_pool_")
        init_file = os.path.join(self._init_dir, "store")
        self._conns: list[Connection] = []
        self._processes = []
        for rank in range(world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=_worker, args=(rank, world_size, init_file, cache_dir, child), daemon=True
            )
            process.start()
            self._conns.append(parent)
            self._processes.append(process)

    def run(self, fn: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        if self.broken:
            raise RuntimeError("this DistPool was closed after a rank stopped answering")
        name = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
        payload = _dumps((args, kwargs))
        for conn in self._conns:
            conn.send((name, payload))
        replies = []
        for rank, conn in enumerate(self._conns):
            try:
                if not conn.poll(self.reply_timeout_s):
                    raise TimeoutError(f"no answer within {self.reply_timeout_s} s")
                replies.append(conn.recv())
            except (EOFError, OSError) as error:  # died, or hangs (TimeoutError is an OSError)
                self.close()
                raise RankError(f"rank {rank} gave no answer to {name}: {error!r}") from error
        failures = [
            (rank, text) for rank, (status, text) in enumerate(replies) if status == "error"
        ]
        if failures:
            rank, text = failures[0]
            raise RankError(f"{name} failed on rank {rank} of {self.world_size}:\n{text}")
        return [_loads(data) for _, data in replies]

    def close(self) -> None:
        """Stop the workers: politely when they answer, by their process ids otherwise."""
        self.broken = True
        for conn, process in zip(self._conns, self._processes, strict=True):
            if process.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(self._init_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def dist_pools(compile_cache_dir: Path) -> Iterator[Callable[[int], DistPool]]:
    """`get(world_size) -> DistPool`: one pool per world size, created on first use, replaced if
    a previous test left it broken, closed at the end of the session."""
    pools: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if world_size not in pools or pools[world_size].broken:
            pools[world_size] = DistPool(world_size, str(compile_cache_dir))
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
