"""What a rank runs in the layer-stop tests: a tiny Llama whose layers carry LayerStops, one
forward and backward armed, a stop asked for on chosen ranks at a chosen place. Runs in the
test process (one rank) and on every rank of a pool."""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from slurm_autosp.compile import decoder_layers
from slurm_autosp.lifecycle.layer_stops import LayerStops, StepInterrupted
from slurm_autosp.lifecycle.signals import StopRequest
from tests.compile.sp_cases import tiny_model

LAYERS = 4


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
    ran: list[int] = []
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda _m, _a, index=index: ran.append(index))
    asks = dist.get_rank() in stopping_ranks
    if stop_in == "forward" and asks:
        layers[1].register_forward_hook(lambda *_: setattr(stop, "signal_name", "SIGUSR2"))
    if compiled:
        for layer in layers:
            layer.compile(backend="eager")
    stops = LayerStops.install(layers, stop, dist.group.WORLD)
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    interrupted = False
    try:
        with stops.armed():
            loss = model(input_ids=tokens, labels=tokens).loss
            if stop_in == "backward" and asks:
                stop.signal_name = "SIGTERM"
            loss.backward()
    except StepInterrupted:
        interrupted = True
    with_grads = [
        i for i, layer in enumerate(layers) if layer.mlp.down_proj.weight.grad is not None
    ]
    return Outcome(interrupted, stops.boundaries, ran, with_grads)
