"""What a rank runs in the layer-stop tests: a tiny Llama whose layers carry LayerStops, one
forward and backward armed, a stop asked for on chosen ranks at a chosen place. Runs in the
test process (one rank) and on every rank of a pool."""

import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from slurm_autosp.compile import decoder_layers
from slurm_autosp.lifecycle.layer_stops import LayerStops, StepInterrupted
from slurm_autosp.lifecycle.signals import StopRequest
from tests.compile.sp_cases import tiny_model

LAYERS = 4
_TOKENS = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))


@dataclass
class Outcome:
    interrupted: bool
    boundaries: int  # passed when the step ended or stopped
    forward_layers: list[int]  # the layers whose forward ran, in order
    layers_with_grads: list[int]  # the layers whose weights got a gradient


def armed_step(stop_in: str, stopping_ranks: list[int], compiled: bool) -> Outcome:
    """One forward and backward with every layer's boundaries armed. `stop_in`: 'forward'
    (the stop is asked for inside layer 1's forward), 'backward' (between forward and
    backward), or 'none'; only on `stopping_ranks`."""
    model = tiny_model("llama", 2, layers=LAYERS)
    layers = decoder_layers(model)
    stop = StopRequest()
    ran = _record_forwards(layers)
    asks = dist.get_rank() in stopping_ranks
    if stop_in == "forward" and asks:
        layers[1].register_forward_hook(lambda *_: setattr(stop, "signal_name", "SIGUSR2"))
    if compiled:
        for layer in layers:
            layer.compile(backend="eager")
    stops = LayerStops.install(layers, stop, dist.group.WORLD)
    interrupted = False
    try:
        with stops.armed():
            loss = model(input_ids=_TOKENS, labels=_TOKENS).loss
            if stop_in == "backward" and asks:
                stop.signal_name = "SIGTERM"
            loss.backward()
    except StepInterrupted:
        interrupted = True
    return Outcome(interrupted, stops.boundaries, ran, _layers_with_grads(layers))


def usr2_in_a_backward_run_as_on_cuda(signalled_rank: int) -> Outcome:
    """One forward and backward with every layer's boundaries armed, the backward run as CUDA
    runs it: on another thread while the main thread waits in C++, where Python runs no
    signal handler. On `signalled_rank` the thread running the backward gets a real USR2
    inside layer 3's backward (a process-directed one may land on any of the rank's threads;
    this one lands before the backward goes on)."""
    model = tiny_model("llama", 2, layers=LAYERS)
    layers = decoder_layers(model)
    ran = _record_forwards(layers)
    if dist.get_rank() == signalled_rank:
        layers[3].mlp.down_proj.weight.register_hook(
            lambda _grad: signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)
        )
    stop = StopRequest.install()
    try:
        stops = LayerStops.install(layers, stop, dist.group.WORLD)
        interrupted = False
        try:
            with stops.armed():
                _backward_on_another_thread(model(input_ids=_TOKENS, labels=_TOKENS).loss)
        except StepInterrupted:
            interrupted = True
    finally:
        stop.close()
    return Outcome(interrupted, stops.boundaries, ran, _layers_with_grads(layers))


def _record_forwards(layers: list[nn.Module]) -> list[int]:
    ran: list[int] = []
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda _m, _a, index=index: ran.append(index))
    return ran


def _layers_with_grads(layers: list[nn.Module]) -> list[int]:
    return [i for i, layer in enumerate(layers) if layer.mlp.down_proj.weight.grad is not None]


def _backward_on_another_thread(loss: torch.Tensor) -> None:
    """`loss.backward()` on a thread of its own while this one waits in C++
    (torch.futures.Future.wait); raises what the backward raised."""
    done: torch.futures.Future[None] = torch.futures.Future()

    def backward() -> None:
        try:
            loss.backward()
            done.set_result(None)
        except Exception as error:  # noqa: BLE001 - raised again by the wait below
            done.set_exception(error)

    threading.Thread(target=backward).start()
    done.wait()
