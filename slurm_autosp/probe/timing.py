"""How the probe and the GPU check time a collective, as nccl-tests does: a sample is CALLS
back-to-back calls between two readings of one timer, divided by CALLS; the median of SAMPLES
samples (after WARMUP calls) is the time of one call. One call timed alone from the host
(barrier, synchronize, clock, call, synchronize, clock) would also count the kernel launch and
the ranks' skew leaving the barrier, which on NVLink are as long as the transfer itself. The
timer is the device's own: CUDA events on the current stream around the calls on GPU (a
synchronous collective orders its NCCL work between them), the host's clock on CPU, where
gloo's calls return when done.

Bandwidths follow nccl-tests too: `algbw` is the bytes each rank sends (all-to-all) or
contributes (all-reduce, reduce-scatter) over the time of one call; `busbw` scales it by what
crosses each link, (n-1)/n for all-to-all and reduce-scatter and 2(n-1)/n for all-reduce, so it
compares with a link's bandwidth whatever the group size. Latency is the time of the same
collective with one element per rank.

torch alone: the GPU check's bandwidth processes import this and nothing heavier.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

WARMUP = 5  # calls, untimed: connections, NCCL's channels and buffers set up
CALLS = 20  # back-to-back calls per sample
SAMPLES = 5  # the median is reported
# NVLink bandwidth per GPU, each way, GB/s (vendor data sheets: NVLink 5 900, NVLink 4 450,
# H800's 400 total = 200, NVLink 3 300, A800 200), matched against the device name in order.
# Only SP groups inside one NVLink domain are held to it; nothing is published for gloo on CPU,
# for links between nodes (that depends on the NICs per GPU) or for other GPUs.
NVLINK_GB_PER_S = (
    ("GB200", 900.0),
    ("B200", 900.0),
    ("H200", 450.0),
    ("H800", 200.0),
    ("H100 PCIE", None),
    ("H100 NVL", None),
    ("H100", 450.0),
    ("A800", 200.0),
    ("A100", 300.0),
)
BUS_FACTOR = {"all_to_all": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}  # x (n-1)/n


def bus_factor(collective: str, ranks: int) -> float:
    """busbw / algbw: what crosses each link per byte a rank sends or contributes; a ring pass
    (`send_recv`, ring attention's block to the next rank) sends every byte over one link."""
    if collective == "send_recv":
        return 1.0
    return BUS_FACTOR[collective] * (ranks - 1) / ranks


@dataclass(frozen=True)
class Message:
    """One collective the training step runs, at its size."""

    collective: str  # all_to_all | all_reduce | reduce_scatter | send_recv (a ring pass)
    what: str  # what training sends with it
    group: str  # sp (the Ulysses group) | ring | dp
    nbytes: int  # per rank
    dtype: torch.dtype


def nvlink_bandwidth(device: torch.device) -> tuple[float | None, str]:
    """The NVLink bandwidth per GPU, each way, that GPUs of one domain are held to."""
    name = torch.cuda.get_device_name(device).upper()
    for key, gb_per_s in NVLINK_GB_PER_S:
        if key in name:
            if gb_per_s is None:
                break
            return gb_per_s, f"NVLink of {key}, each way"
    return None, f"no nominal: no NVLink figure for {name}"


def _call(collective: str, send: torch.Tensor, group: dist.ProcessGroup) -> Callable[[], None]:
    """The collective on preallocated buffers, so a timed call allocates nothing."""
    n = dist.get_world_size(group)
    if collective == "send_recv":  # ring attention's: to the next ring rank, from the previous
        received, rank = torch.empty_like(send), dist.get_rank(group)

        def ring_pass() -> None:
            ops = [
                dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % n),
                dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % n),
            ]
            for request in dist.batch_isend_irecv(ops):
                request.wait()

        return ring_pass
    if collective == "all_to_all":
        received = torch.empty_like(send)
        return lambda: dist.all_to_all_single(received, send, group=group)
    if collective == "reduce_scatter":
        shard = torch.empty(send.numel() // n, dtype=send.dtype, device=send.device)
        return lambda: dist.reduce_scatter_tensor(shard, send, group=group)
    return lambda: dist.all_reduce(send, group=group)


class _EventTimer:
    """The device's time between two points of the current stream (CUDA events)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.current_stream(device)
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self.begin.record(self.stream)

    def seconds(self) -> float:
        self.end.record(self.stream)
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1e3


class _HostTimer:
    """The host's clock: gloo's collectives on CPU return when they are done."""

    def start(self) -> None:
        self.begin = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.begin


def timer_for(device: torch.device) -> _EventTimer | _HostTimer:
    return _EventTimer(device) if device.type == "cuda" else _HostTimer()


def per_call_seconds(
    run: Callable[[], None], group: dist.ProcessGroup, device: torch.device
) -> float:
    """The median over SAMPLES of the time of CALLS back-to-back calls, over CALLS. The ranks
    line up once per sample (barrier, and on GPU the device drained), never between calls."""
    for _ in range(WARMUP):
        run()
    timer = timer_for(device)
    samples = []
    for _ in range(SAMPLES):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timer.start()
        for _ in range(CALLS):
            run()
        samples.append(timer.seconds() / CALLS)
    return statistics.median(samples)


def time_message(
    m: Message, group: dist.ProcessGroup, device: torch.device
) -> tuple[int, float, float]:
    """(bytes per rank as sent, seconds per call, latency per call) of one message: the buffer
    is cut to a multiple of the group size, so it divides into the group's chunks. Zeros: a
    sum of them neither grows nor overflows however often it is repeated."""
    size = dist.get_world_size(group)
    element = torch.empty((), dtype=m.dtype).element_size()
    numel = m.nbytes // element // size * size
    send = torch.zeros(numel, dtype=m.dtype, device=device)
    seconds = per_call_seconds(_call(m.collective, send, group), group, device)
    del send
    tiny = torch.zeros(size, dtype=m.dtype, device=device)
    latency = per_call_seconds(_call(m.collective, tiny, group), group, device)
    return numel * element, seconds, latency
