"""Collective bandwidth across the GPUs of this node, for the GPU check: one process per GPU
(NCCL, or RCCL on ROCm builds), an all-reduce and an all-to-all of NBYTES per rank timed as the
probe times them (collectives.time_message), the slowest rank's time held to the NVLink figure.
On CPU, 2 gloo processes run the same code: the self-test of this path.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurm_autosp.gpu_check.rows import Row
from slurm_autosp.probe.timing import BUS_FACTOR, Message, nvlink_bandwidth, time_message

COLLECTIVES = ("all_reduce", "all_to_all")
BANDWIDTH_FLOOR = 0.70  # of nominal, as the probe's verdict
TIMEOUT_S = 600


@dataclass(frozen=True)
class Bandwidth:
    """One collective over every rank: the slowest rank's time per call."""

    collective: str
    ranks: int
    nbytes: int
    seconds: float
    latency_s: float
    nominal_gb_per_s: float | None
    nominal_source: str

    @property
    def busbw_gb_per_s(self) -> float:
        n = self.ranks
        return self.nbytes / self.seconds / 1e9 * BUS_FACTOR[self.collective] * (n - 1) / n

    @property
    def within(self) -> bool | None:
        """Whether busbw reaches BANDWIDTH_FLOOR of nominal; None without a nominal figure."""
        if self.nominal_gb_per_s is None:
            return None
        return self.busbw_gb_per_s >= BANDWIDTH_FLOOR * self.nominal_gb_per_s


def _rank(rank: int, ranks: int, on_gpu: bool, store: str, nbytes: int, results: Any) -> None:
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
        device_id=device if on_gpu else None,
    )
    try:
        dtype = torch.bfloat16 if on_gpu else torch.float32
        world = dist.new_group()
        timed = [
            (c, *time_message(Message(c, "node", "node", nbytes, dtype), world, device))
            for c in COLLECTIVES
        ]
        nominal = nvlink_bandwidth(device) if on_gpu else (None, "no nominal: gloo on CPU")
        results.put((rank, timed, nominal))
    finally:
        dist.destroy_process_group()


def measure_bandwidth(ranks: int, on_gpu: bool, nbytes: int) -> list[Bandwidth]:
    """Start `ranks` processes (spawned: this one may hold a CUDA context), time every
    collective of COLLECTIVES on all of them, and give each one's slowest rank."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="gpu_check_store_") as tmp:
        store = str(Path(tmp) / "store")
        processes = [
            context.Process(target=_rank, args=(r, ranks, on_gpu, store, nbytes, results))
            for r in range(ranks)
        ]
        for process in processes:
            process.start()
        try:
            replies = [results.get(timeout=TIMEOUT_S) for _ in processes]
        finally:
            for process in processes:
                process.join(timeout=60)
                if process.is_alive():
                    process.kill()
    nominal, source = replies[0][2]
    rows = []
    for index, collective in enumerate(COLLECTIVES):
        timings = [timed[index] for _, timed, _ in replies]
        slowest = max(timings, key=lambda t: t[2])
        rows.append(
            Bandwidth(collective, ranks, slowest[1], slowest[2], slowest[3], nominal, source)
        )
    return rows


def bandwidth_rows(ranks: int, on_gpu: bool, nbytes: int) -> list[Row]:
    """The table's rows: each collective's busbw against the floor of nominal; one row saying
    so where there is one GPU."""
    if ranks < 2:
        return [Row("bandwidth", "one GPU visible", "-", "-", "skipped")]
    return [
        Row(
            "bandwidth",
            f"{b.collective} x{b.ranks}, {b.nbytes / 2**20:,.0f} MiB",
            "-"
            if b.nominal_gb_per_s is None
            else f">= {BANDWIDTH_FLOOR:.0%} of {b.nominal_gb_per_s:g} GB/s",
            f"busbw {b.busbw_gb_per_s:,.1f} GB/s, {b.seconds * 1e3:.3f} ms/call",
            {None: "no nominal", True: "within", False: "BELOW"}[b.within],
            detail=f"{b.nominal_source}; latency {b.latency_s * 1e6:.1f} us (one element per rank)",
        )
        for b in measure_bandwidth(ranks, on_gpu, nbytes)
    ]
