"""What every rank runs in the tiling tests: an AutoSP step with tiled MLPs or tiled decoder
layers against the single-device reference, and optimizer steps through the real engines with
tiling off and on.

Backends, SP groups, engines and batches come from sp_cases and train_cases, so these cases
share the pools' compiled graphs with the equivalence tests.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager

import sp_cases
import torch
import torch.distributed as dist
from sp_cases import Case, contiguous_sp_group, sp_step
from train_cases import (
    _engine,
    _grad_error,
    _job_config,
    _whole_weights,
    take_steps,
)

from slurm_autosp.compile import AutoSPBackend, compile_model
from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.compile.tiled_layer import SequenceTiledLayer
from slurm_autosp.compile.tiling import SequenceTiled
from slurm_autosp.config import ActivationCheckpointing
from slurm_autosp.sp import set_sp_group

_full_backends: dict[tuple[int, bool, int], AutoSPBackend] = {}
_sp_cases_backend_for = sp_cases.backend_for  # before _sp_step_compiles_tiled replaces it


def backend_for(
    sp_size: int, per_layer: bool, whole_layers: bool = False, ring_size: int = 1
) -> AutoSPBackend:
    """sp_cases' backend, or under `full` (where tile_tokens tiles whole decoder layers) one per
    layout and process of our own."""
    if not whole_layers:
        return _sp_cases_backend_for(sp_size, per_layer, ring_size)
    spec = ActivationCheckpointSpec(ActivationCheckpointing.full)
    return _full_backends.setdefault(
        (sp_size, per_layer, ring_size), AutoSPBackend(sp_size, spec, ring_size)
    )


def _tiled(model: torch.nn.Module) -> int:
    """How many MLPs or decoder layers run in sequence tiles."""
    return sum(isinstance(m, SequenceTiled | SequenceTiledLayer) for m in model.modules())


@contextmanager
def _sp_step_compiles_tiled(tile_tokens: int, whole_layers: bool) -> Iterator[list[int]]:
    """Make sp_step compile its SP model tiled (it calls sp_cases' compile_model and
    backend_for; `whole_layers`: under `full`, so whole layers are tiled) and yield, per model
    it compiled, how many MLPs or layers are tiled: a test that tiled nothing must fail."""
    tiled: list[int] = []

    def compile_tiled(model: torch.nn.Module, *args, **kwargs) -> None:
        compile_model(model, *args, **kwargs, tile_tokens=tile_tokens)
        tiled.append(_tiled(model))

    def backend(sp_size: int, per_layer: bool, ring_size: int = 1) -> AutoSPBackend:
        return backend_for(sp_size, per_layer, whole_layers, ring_size)

    originals = sp_cases.compile_model, sp_cases.backend_for
    sp_cases.compile_model, sp_cases.backend_for = compile_tiled, backend
    try:
        yield tiled
    finally:
        sp_cases.compile_model, sp_cases.backend_for = originals


def tiled_sp_step(
    case: Case, sp_size: int, tile_tokens: int, whole_layers: bool = False, ring_size: int = 1
) -> dict:
    """sp_cases.sp_step (errors against the plain single-device model) with the SP model's MLPs
    (or, `whole_layers`, its decoder layers) tiled, plus how many it tiled."""
    with _sp_step_compiles_tiled(tile_tokens, whole_layers) as tiled:
        result = sp_step(case, sp_size, ring_size)
    return {**result, "tiled": tiled}


def _first_grads(engine, zero_stage: int) -> dict[str, torch.Tensor]:
    """The gradients the engine holds after the first micro-batch, before its optimizer step:
    reduced shards under FSDP2 (gathered), this rank's own under ZeRO-1 (DeepSpeed reduces them
    at the accumulation boundary and then drops .grad)."""
    params = engine.module.named_parameters()
    if zero_stage == 3:
        return {name: p.grad.full_tensor() for name, p in params}
    return {name: p.grad.clone() for name, p in params}


def _engine_run(
    zero_stage: int, sp_size: int, tile_tokens: int, steps: int, whole_layers: bool
) -> dict:
    """`steps` optimizer steps of two micro-batches each through the engine for `zero_stage`
    (train_cases.engine_steps' set-up), with the MLPs (`whole_layers`: the decoder layers, under
    `full`) tiled when tile_tokens > 0: the initial
    and final whole weights (rank 0's under FSDP2), each step's loss and gradient norm, and the
    first micro-batch's gradients."""
    grad_accum = 2
    cfg = _job_config(dist.get_world_size(), zero_stage, grad_accum, steps)
    engine = _engine(zero_stage, cfg)
    initial = _whole_weights(engine)
    compile_model(
        engine.module,
        backend_for(sp_size, True, whole_layers),
        per_layer=True,
        tile_tokens=tile_tokens,
    )
    set_sp_group(contiguous_sp_group(sp_size))
    first_grads: dict[str, torch.Tensor] = {}

    def keep_first_grads(micro: int) -> None:
        if not first_grads:
            first_grads.update(_first_grads(engine, zero_stage))

    losses, grad_norms = take_steps(
        engine, range(steps), sp_size, grad_accum, after_backward=keep_first_grads
    )
    final = _whole_weights(engine)
    tiled = _tiled(engine.module)
    engine.close()
    return {
        "initial": initial,
        "final": final,
        "losses": losses,
        "grad_norms": grad_norms,
        "first_grads": first_grads,
        "tiled": tiled,
    }


def _relative(values: list[float], references: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(values, references, strict=True))


def _worst_over_ranks(value: float) -> float:
    worst = torch.tensor(value)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def engine_tiled_vs_untiled(
    zero_stage: int, sp_size: int, tile_tokens: int, steps: int = 2, whole_layers: bool = False
) -> dict | None:
    """The same optimizer steps through the engine with the MLPs (`whole_layers`: the decoder
    layers, both runs under `full`) untiled, then tiled; rank 0
    returns their relative differences: per-step loss and gradient norm; the first micro-batch's
    gradients (worst parameter's max|g - g_ref| / max|g_ref|, worst rank); the final weights
    (worst parameter's max|w - w_ref| over how far the untiled steps moved it, max|w_ref - w_0|)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # one machine: local rank = rank
    untiled = _engine_run(zero_stage, sp_size, 0, steps, whole_layers)
    tiled = _engine_run(zero_stage, sp_size, tile_tokens, steps, whole_layers)
    grad_error = _worst_over_ranks(
        max(
            _grad_error(tiled["first_grads"][name], g) for name, g in untiled["first_grads"].items()
        )
    )
    if dist.get_rank() != 0:
        return None
    initial, final = untiled["initial"], untiled["final"]
    return {
        "same_initial_weights": all(
            torch.equal(tiled["initial"][k], v) for k, v in initial.items()
        ),
        "tiled": (untiled["tiled"], tiled["tiled"]),
        "loss_rel_error": _relative(tiled["losses"], untiled["losses"]),
        "grad_norm_rel_error": _relative(tiled["grad_norms"], untiled["grad_norms"]),
        "grad_rel_error": grad_error,
        "weight_rel_error": max(
            _grad_error(tiled["final"][k] - initial[k], w - initial[k]) for k, w in final.items()
        ),
    }
