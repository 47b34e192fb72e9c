"""What every rank of a pool runs in the probe's collective tests: the probe's own timing of a
real gloo collective, with each call's start and end on the host clock beside it."""

import time

import torch
import torch.distributed as dist

from slurm_autosp.probe import timing
from slurm_autosp.probe.timing import Message


def timed_calls(collective: str, nbytes: int) -> dict:
    """`per_call_seconds` of one collective on the world group, each call recorded; then the
    same message through `time_message`, as the probe times it."""
    send = torch.zeros(nbytes // 4, dtype=torch.float32)
    run = timing._call(collective, send, dist.group.WORLD)
    spans = []

    def recorded() -> None:
        begin = time.perf_counter()
        run()
        spans.append((begin, time.perf_counter()))

    seconds = timing.per_call_seconds(recorded, dist.group.WORLD, torch.device("cpu"))
    message = Message(collective, "test", "dp", nbytes, torch.float32)
    sent, per_call, latency = timing.time_message(message, dist.group.WORLD, torch.device("cpu"))
    return {"seconds": seconds, "spans": spans, "message": (sent, per_call, latency)}
