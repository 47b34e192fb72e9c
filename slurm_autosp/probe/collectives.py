"""Collective bandwidth and latency on the job's own SP and DP groups, at the message sizes
its training step sends, beside the link's nominal bandwidth where one is published.

Timing follows nccl-tests: a sample is CALLS back-to-back calls between two readings of one
timer, divided by CALLS; the median of SAMPLES samples (after WARMUP calls) is the time of one
call. One call timed alone from the host (barrier, synchronize, clock, call, synchronize, clock)
would also count the kernel launch and the ranks' skew leaving the barrier, which on NVLink are
as long as the transfer itself. The timer is the device's own: CUDA events on the current
stream around the calls on GPU (a synchronous collective orders its NCCL work between them), the
host's clock on CPU, where gloo's calls return when done.

Bandwidths follow nccl-tests too: `algbw` is the bytes each rank sends (all-to-all) or
contributes (all-reduce, reduce-scatter) over the time of one call; `busbw` scales it by what
crosses each link, (n-1)/n for all-to-all and reduce-scatter and 2(n-1)/n for all-reduce, so it
compares with a link's bandwidth whatever the group size. Latency is the time of the same
collective with one element per rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slurm_autosp.config import JobConfig, Precision
from slurm_autosp.launch.placement import Parallel
from slurm_autosp.model import hf_config
from slurm_autosp.plan import model_size
from slurm_autosp.plan.memory import REDUCE_BYTES, ZERO_BUCKET_ELEMENTS
from slurm_autosp.probe.stop import AgreedStop

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


@dataclass(frozen=True)
class Message:
    """One collective the training step runs, at its size."""

    collective: str  # all_to_all | all_reduce | reduce_scatter
    what: str  # what training sends with it
    group: str  # sp | dp
    nbytes: int  # per rank
    dtype: torch.dtype


@dataclass(frozen=True)
class CollectiveTiming:
    """One rank's time per call of one message, and of the one-element latency probe."""

    collective: str
    what: str
    group: str
    group_index: int  # which SP (or DP) group this rank is in
    group_size: int
    nbytes: int
    seconds: float  # per call: the median sample of CALLS back-to-back calls, over CALLS
    latency_s: float
    calls: int  # back-to-back calls per sample
    nominal_gb_per_s: float | None
    nominal_source: str

    @property
    def algbw_gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def busbw_gb_per_s(self) -> float:
        n = self.group_size
        return self.algbw_gb_per_s * BUS_FACTOR[self.collective] * (n - 1) / n


def _element_bytes(cfg: JobConfig) -> tuple[torch.dtype, int]:
    return (torch.bfloat16, 2) if cfg.precision is Precision.bf16 else (torch.float32, 4)


def step_messages(cfg: JobConfig, zero_stage: int) -> list[Message]:
    """The Ulysses all-to-alls of one attention call (q and the output [B, H, S/P, D]; k and v
    with their heads repeated up to P when fewer) and the gradient reduction over DP groups
    (ZeRO-1: DeepSpeed's bucket, at most the model; ZeRO-3: one layer's fp32 gradient)."""
    hf = hf_config(cfg.model)
    dtype, b = _element_bytes(cfg)
    sp, micro = cfg.parallel.sp_size, cfg.train.micro_batch
    local = -(-cfg.data.seq_len // sp)
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    sent_kv = kv_heads if kv_heads % sp == 0 else sp
    messages = []
    if sp > 1:
        messages.append(
            Message(
                "all_to_all", "q / attention out", "sp", micro * heads * local * head_dim * b, dtype
            )
        )
        messages.append(
            Message("all_to_all", "k / v", "sp", micro * sent_kv * local * head_dim * b, dtype)
        )
    if cfg.dp_size > 1:
        size = model_size(cfg)
        if zero_stage == 3:
            grads = Message(
                "reduce_scatter",
                "layer gradient (fp32)",
                "dp",
                size.layer * REDUCE_BYTES,
                torch.float32,
            )
            messages += [
                grads,
                Message("all_reduce", "layer gradient (fp32)", "dp", grads.nbytes, torch.float32),
            ]
        else:
            nbytes = int(min(size.total, ZERO_BUCKET_ELEMENTS)) * b
            messages += [
                Message("all_reduce", "gradient bucket", "dp", nbytes, dtype),
                Message("reduce_scatter", "gradient bucket", "dp", nbytes, dtype),
            ]
    return messages


def nominal_bandwidth(cfg: JobConfig, group: str, device: torch.device) -> tuple[float | None, str]:
    """The published per-link bandwidth this group's busbw is held to, and where it came from."""
    if device.type != "cuda":
        return None, "no nominal: gloo on CPU"
    if group != "sp" or cfg.parallel.allow_cross_domain:
        return None, "no nominal: between nodes it depends on the NICs per GPU"
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


def time_collectives(
    cfg: JobConfig,
    parallel: Parallel,
    device: torch.device,
    rank: int,
    zero_stage: int,
    stop: AgreedStop | None = None,
) -> list[CollectiveTiming]:
    """Time every message of `step_messages` on this rank's group (every rank takes part); an
    agreed stop request ends the timing between two messages."""
    layout = parallel.layout
    groups = {
        "sp": (parallel.sp_group, layout.dp_rank(rank), layout.sp_size),
        "dp": (parallel.dp_group, layout.sp_rank(rank), layout.dp_size),
    }
    timings: list[CollectiveTiming] = []
    for m in step_messages(cfg, zero_stage):
        if stop is not None and stop.requested(f"{len(timings)} collectives timed"):
            break
        group, index, size = groups[m.group]
        nbytes, seconds, latency = time_message(m, group, device)
        nominal, source = nominal_bandwidth(cfg, m.group, device)
        timings.append(
            CollectiveTiming(
                m.collective,
                m.what,
                m.group,
                index,
                size,
                nbytes,
                seconds,
                latency,
                CALLS,
                nominal,
                source,
            )
        )
    return timings
