"""What the activation-offload tests run: the forward under `ActivationOffload.saving()`, the
backward as usual, against the same step without offload; in-process (eager) and on every rank
of a pool (compiled per layer with the AutoSP backend, and through the real engines).

Saved bytes are counted by a plain pair of saved-tensor hooks, apart from the offload's own
bookkeeping. Backends, SP groups and batches come from sp_cases and train_cases, so these cases
share the pools' compiled graphs with the equivalence tests.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
from sp_cases import VOCAB, backend_for, contiguous_sp_group, tiny_model
from train_cases import (
    SEQ,
    _engine,
    _grad_error,
    _job_config,
    _kwargs,
    _sp_shards,
    _whole_weights,
    take_steps,
)

from slurm_autosp.compile import compile_model
from slurm_autosp.sp import loss_scale, set_sp_group
from slurm_autosp.sp.offload import ActivationOffload
from slurm_autosp.verify import make_batch

LAYERS = 2  # tiny_model's default depth


@contextmanager
def counting_saved(nonparameter: list[int], parameter: list[int]) -> Iterator[None]:
    """Record the bytes of every tensor the forward saves, parameters (and their views) apart."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        is_parameter = isinstance(tensor, torch.nn.Parameter) or isinstance(
            tensor._base, torch.nn.Parameter
        )
        (parameter if is_parameter else nonparameter).append(tensor.nbytes)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


# ------------------------------------------------------------------ one process, eager


def interleaved_micro_batches(
    offload: ActivationOffload | None, layers: int
) -> tuple[list[float], dict]:
    """Two micro-batches whose forwards both run before either backward (second one first), so two
    offload sessions are alive at once; returns the losses and the accumulated gradients."""
    model = tiny_model("llama", 2, layers=layers)
    losses = []
    for seed in (1, 2):
        batch = make_batch(1, SEQ, VOCAB, seed=seed)
        with offload.saving() if offload else nullcontext():
            losses.append(model(**batch, use_cache=False).loss)
    for loss in reversed(losses):
        loss.backward()
    return [float(loss.detach()) for loss in losses], {
        name: p.grad for name, p in model.named_parameters()
    }


def eager_saved_bytes(layers: int) -> tuple[list[int], list[int]]:
    """What the two forwards of `interleaved_micro_batches` save, counted without offload."""
    model = tiny_model("llama", 2, layers=layers)
    nonparameter, parameter = [], []
    with counting_saved(nonparameter, parameter):
        for seed in (1, 2):
            model(**make_batch(1, SEQ, VOCAB, seed=seed), use_cache=False)
    return nonparameter, parameter


# ------------------------------------------------------------------ SP ranks, compiled per layer


def sp_offload_step(sp_size: int, grad_accum: int) -> dict:
    """train_cases.grad_accum_step with every micro-batch's forward under offload (min_bytes=0:
    every non-parameter saved tensor moves). Every rank returns its offload figures and the
    bytes its forwards save, counted by a forward of each micro-batch without offload; rank 0
    also the errors against one single-device batch holding every sequence of the step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = world // sp_size * grad_accum
    batch = make_batch(rows, SEQ, VOCAB, seed=11)
    shards, count = _sp_shards(batch, sp_size, grad_accum)

    model = tiny_model("llama", 2)
    compile_model(model, backend_for(sp_size, True), per_layer=True)
    set_sp_group(contiguous_sp_group(sp_size))
    nonparameter, parameter = [], []
    with counting_saved(nonparameter, parameter):
        for shard in shards:
            model(**_kwargs(shard, count))
    offload = ActivationOffload(torch.device("cpu"), layers=LAYERS, min_bytes=0)
    step_loss = torch.zeros(())
    for shard in shards:
        with offload.saving():
            loss = model(**_kwargs(shard, count)).loss
        (loss * loss_scale(world, grad_accum) / grad_accum).backward()
        step_loss += loss.detach()
    dist.all_reduce(step_loss)
    result = {
        **asdict(offload.stats),
        "saved_nonparameter_bytes": sum(nonparameter),
        "saved_parameter_bytes": sum(parameter),
        "per_micro_batch_bytes": sum(nonparameter) / grad_accum,  # the shards are one shape
    }
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)
        grads[name] = param.grad / world
    if rank != 0:
        return result

    reference = tiny_model("llama", 2)
    ref_loss = reference(**batch, use_cache=False).loss
    ref_loss.backward()
    errors = {name: _grad_error(grads[name], p.grad) for name, p in reference.named_parameters()}
    return {
        **result,
        "loss_rel_error": float((step_loss - ref_loss.detach()).abs() / ref_loss.detach().abs()),
        "grad_rel_error": max(errors.values()),
        "worst_param": max(errors, key=errors.get),
    }


# ------------------------------------------------------------------ the real engines


def engine_run(
    zero_stage: int, sp_size: int, grad_accum: int, steps: int, offload: bool
) -> dict | None:
    """train_cases.engine_steps' optimizer steps through the engine for `zero_stage` (DeepSpeed
    ZeRO-1, or FSDP2), each micro-batch's forward (chunked loss included) under offload or not.
    Rank 0 returns the step losses, gradient norms, the initial and final whole weights and the
    offload figures."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # one machine: local rank = rank
    cfg = _job_config(dist.get_world_size(), zero_stage, grad_accum, steps)
    engine = _engine(zero_stage, cfg)
    initial = _whole_weights(engine)
    compile_model(engine.module, backend_for(sp_size, True), per_layer=True)
    set_sp_group(contiguous_sp_group(sp_size))
    offloader = ActivationOffload(torch.device("cpu"), layers=LAYERS, min_bytes=0)
    saving = offloader.saving if offload else nullcontext
    losses, grad_norms = take_steps(engine, range(steps), sp_size, grad_accum, saving)
    weights = _whole_weights(engine)
    engine.close()
    if dist.get_rank() != 0:
        return None
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "initial": initial,
        "weights": weights,
        **asdict(offloader.stats),
    }
