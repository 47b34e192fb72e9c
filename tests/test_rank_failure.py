"""One rank's error in any collective region ends every rank of the job within a minute, each
naming the failing rank, its host and its error (cluster/rank_failure.py; the topology check
gathers a detection's error instead). Each case runs the job's own code on two local processes
over a real gloo group, one rank's error injected at the region's real call site
(tests/rank_failure_cases.py), with a collective timeout of 90 s: a rank left waiting, as before
the agreement, outlives the bound. The ranks are forked from a server that imported the job's
modules once; each case needs fresh ones, since the failure ends them.

gloo releases a rank waiting for a peer whose process has exited (its connections close); NCCL
does not. The watch's own cases keep the failed peer alive in the group, or stop the store's
host without closing anything, as NCCL ranks would see them."""

import multiprocessing as mp
import re
import socket
import time
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

import pytest
import rank_failure_cases as cases

from slurm_autosp.cluster.rank_failure import EXIT_STATUS, GRACE_S, POLL_S, STORE_TIMEOUT_S

BOUND_S = 60  # from the failing rank's error to every rank's exit
NAMED = re.compile(
    rf"rank {cases.FAILING_RANK} \({re.escape(socket.gethostname())}\) failed: "
    rf"\w+: .*{re.escape(cases.ERROR)}"
)


@pytest.fixture(scope="module")
def forkserver() -> ForkServerContext:
    """The job's modules imported once, in the server (which has the repository, not tests/,
    on its path)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["slurm_autosp.probe.probe_job"])
    return context


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(
    context: ForkServerContext,
    root: Path,
    target: Callable[..., None],
    arguments: list[tuple[Any, ...]],
    awaited: list[int],
) -> list[tuple[float | None, int | None, str]]:
    """Start a rank per `arguments` (each given its rank, `root` and the port after them);
    wait until the `awaited` ranks have exited or GIVE_UP_S, then kill the rest. Each rank's
    exit, seconds after the fault (None: it did not exit), its exit status and its output."""
    port = _free_port()
    started = time.time()
    ranks = [
        context.Process(target=target, args=(*a, r, str(root), port), daemon=True)
        for r, a in enumerate(arguments)
    ]
    for rank in ranks:
        rank.start()
    ended: dict[int, float] = {}
    deadline = time.monotonic() + cases.GIVE_UP_S
    while not set(awaited) <= set(ended) and time.monotonic() < deadline:
        gone = {r: time.time() for r, p in enumerate(ranks) if r not in ended and not p.is_alive()}
        ended.update(gone)
        time.sleep(0.1)
    for rank in ranks:
        if rank.is_alive():
            rank.kill()
        rank.join()
    fault_at = float((root / cases.FAULT_AT).read_text())
    print(f"the fault came {fault_at - started:.1f} s after the ranks started")
    return [
        (
            round(ended[r] - fault_at, 1) if r in ended else None,
            p.exitcode,
            (root / f"rank_{r}.log").read_text(),
        )
        for r, p in enumerate(ranks)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_one_ranks_error_ends_every_rank_naming_it(forkserver, case, tmp_path):
    everyone = list(range(cases.WORLD_SIZE))
    ends = _run(forkserver, tmp_path, cases.run_rank, [(case,)] * cases.WORLD_SIZE, everyone)
    after = [seconds for seconds, _, _ in ends]
    print(f"{case}: each rank's exit, seconds after rank {cases.FAILING_RANK}'s error: {after}")
    for rank, (seconds, status, output) in enumerate(ends):
        assert seconds is not None and seconds < BOUND_S, (
            f"rank {rank} still ran {BOUND_S} s after rank {cases.FAILING_RANK}'s error "
            f"(exits: {after})\n{output}"
        )
        assert status != 0, output
        assert NAMED.search(output), f"rank {rank}'s output does not name the error:\n{output}"


@pytest.mark.slow
def test_a_rank_waiting_for_a_failed_peer_that_stays_in_the_group_is_ended(forkserver, tmp_path):
    """The failed rank publishes its error and keeps its connections open, so the waiting rank's
    all-reduce never returns by itself: its watch ends it, naming the error."""
    (waited, status, output), _ = _run(
        forkserver, tmp_path, cases.watch_rank, [("waits",), ("fails",)], awaited=[0]
    )
    print(f"the waiting rank exited {waited} s after the error")
    assert waited is not None and waited < BOUND_S, output  # its all-reduce alone waits 90 s
    assert status == EXIT_STATUS and NAMED.search(output) and "ending rank 0 too" in output


@pytest.mark.slow
def test_a_rank_ends_when_the_store_host_stops_answering(forkserver, tmp_path):
    """Rank 0, holding the store, stops (SIGSTOP: like a host powered off, it closes nothing and
    answers nothing) while rank 1 waits for it in an all-reduce: rank 1's watch ends it."""
    _, (waited, status, output) = _run(
        forkserver, tmp_path, cases.watch_rank, [("vanishes",), ("waits",)], awaited=[1]
    )
    print(f"the waiting rank exited {waited} s after rank 0 stopped")
    assert waited is not None and waited < POLL_S + STORE_TIMEOUT_S + GRACE_S + 5 < BOUND_S
    assert status == EXIT_STATUS, output
    assert "which rank 0 holds, stopped answering" in output and "ending rank 1 too" in output
