"""What every rank runs in the resharding tests: a run saved through the checkpoint store on one
world size and SP x DP layout and resumed on another, under the real engines (DeepSpeed ZeRO-1
in engine.zero1_checkpoint's format, FSDP2 through torch distributed checkpoint), and ZeRO-1's
whole optimizer state before a save and after a load on another world size. Batches, backends
and the engines' job config come from train_cases, so these cases share the pools' compiled
graphs."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from sp_cases import VOCAB, backend_for, contiguous_sp_group, tiny_model
from train_cases import _engine, _job_config, take_steps

from slurm_autosp.checkpoint.identity import run_settings
from slurm_autosp.checkpoint.store import CheckpointStore, TrainerState
from slurm_autosp.cluster.placement import layout_for
from slurm_autosp.compile import compile_model
from slurm_autosp.config import LoraConfig, Precision
from slurm_autosp.sp import set_sp_group
from slurm_autosp.verify import make_batch


def _setup(zero_stage: int, sp_size: int, grad_accum: int, steps: int, lora: bool):
    """The engine for SP x DP on this pool, compiled for its SP size, and the settings a job of
    this layout records (its global batch: grad_accum x data-parallel ranks); with `lora`, the
    model's LoRA adapters train, the rest frozen."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # one machine: local rank = rank
    cfg = _job_config(dist.get_world_size(), zero_stage, grad_accum, steps)
    cfg.parallel.sp_size, cfg.parallel.ring_size = sp_size, 1  # Ulysses alone, as compiled
    cfg.model.lora = LoraConfig(rank=4, alpha=8) if lora else None
    engine = _engine(zero_stage, cfg)
    compile_model(engine.module, backend_for(sp_size, True), per_layer=True)
    set_sp_group(contiguous_sp_group(sp_size))
    return engine, cfg, run_settings(cfg, layout_for(cfg), zero_stage)


def saved_run(
    zero_stage: int,
    sp_size: int,
    grad_accum: int,
    steps: int,
    save_after: int,
    checkpoint: str,
    lora: bool = False,
) -> list[float] | None:
    """`steps` optimizer steps, saved through the store after `save_after` of them; rank 0
    returns every step's loss (the uninterrupted run: saving changes nothing)."""
    engine, cfg, settings = _setup(zero_stage, sp_size, grad_accum, steps, lora)
    world = dist.get_world_size()
    losses, _ = take_steps(engine, range(save_after), sp_size, grad_accum)
    state = TrainerState(
        step=save_after,
        samples_consumed=save_after * cfg.global_batch,
        world_size=world,
        layout=settings["parallel.layout"],
        engine=engine.name,
        settings=settings,
    )
    CheckpointStore(Path(checkpoint), dist.get_rank(), world, keep=1).save(engine, state)
    more, _ = take_steps(engine, range(save_after, steps), sp_size, grad_accum)
    engine.close()
    return losses + more if dist.get_rank() == 0 else None


def resumed_run(
    zero_stage: int, sp_size: int, grad_accum: int, steps: int, checkpoint: str, lora: bool = False
) -> dict | None:
    """Resume the newest checkpoint under `checkpoint` on this pool's SP x DP layout and take the
    remaining steps; rank 0 returns the step it resumed at and the losses."""
    engine, _, settings = _setup(zero_stage, sp_size, grad_accum, steps, lora)
    store = CheckpointStore(Path(checkpoint), dist.get_rank(), dist.get_world_size(), keep=1)
    state = store.load_latest(engine, settings)
    assert state is not None, f"nothing to resume under {checkpoint}"
    losses, _ = take_steps(engine, range(state.step, steps), sp_size, grad_accum)
    engine.close()
    return {"step": state.step, "losses": losses} if dist.get_rank() == 0 else None


# ------------------------------------------------------------------ ZeRO-1's state itself


def _zero1(precision: str, offload: bool):
    """A ZeRO-1 engine over the fixed-seed tiny model, uncompiled (nothing here is SP); bf16 on
    CPU ranks is for tests only (the config refuses it)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    cfg = _job_config(dist.get_world_size(), 1, 1, 4)
    cfg.train.precision = Precision(precision)
    from slurm_autosp.engine import ZeRO1Engine

    model = tiny_model("llama", 2).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    return ZeRO1Engine(model, cfg, offload)


def _whole_state(engine) -> dict | None:
    """Collective: every trained parameter's whole fp32 master weights and optimizer state as the
    optimizer holds them (each rank's piece of its flat partitions, summed over the ranks), the
    module's weights, the optimizer's step and the LR schedule's; rank 0 returns them."""
    partition = engine._partition
    optimizer, flats = partition.optimizer, partition.flat_partitions()
    whole = {}
    for name, param in engine.module.named_parameters():
        fragment = partition.fragment(param)
        sources = {"master": None, "exp_avg": None, "exp_avg_sq": None}
        for key in sources:
            buffer = torch.zeros(param.numel(), dtype=torch.float32)
            if fragment is not None:
                flat = flats[fragment.group]
                source = flat if key == "master" else optimizer.state[flat][key]
                buffer.narrow(0, fragment.start, fragment.numel).copy_(
                    source.narrow(0, fragment.offset, fragment.numel)
                )
            dist.all_reduce(buffer)
            whole[f"{name}:{key}"] = buffer
    state = optimizer.state[flats[0]]
    if dist.get_rank() != 0:
        return None
    return {
        "whole": whole,
        "module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "step": float(state["step"]),
        "schedule": engine._engine.lr_scheduler.state_dict()["last_epoch"],
    }


def zero1_state_saved(precision: str, offload: bool, checkpoint: str) -> dict | None:
    """One optimizer step on a batch of its own per rank, then a save to `checkpoint`; rank 0
    returns the whole state (checked against DeepSpeed's own full-state gatherers)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = _zero1(precision, offload)
    batch = make_batch(1, 32, VOCAB, seed=7 + dist.get_rank())
    engine.backward(engine(**batch, use_cache=False).loss * engine.loss_scale)
    engine.step()
    engine.state_files().write(Path(checkpoint))
    state = _whole_state(engine)
    deepspeeds = {}
    for name, param in engine.module.named_parameters():
        deepspeeds[f"{name}:master"] = safe_get_full_fp32_param(param).flatten()
        for key in ("exp_avg", "exp_avg_sq"):
            deepspeeds[f"{name}:{key}"] = safe_get_full_optimizer_state(param, key).flatten()
    engine.close()
    if state is not None:
        state["deepspeed_agrees"] = all(
            torch.equal(deepspeeds[key], value) for key, value in state["whole"].items()
        )
    return state


def zero1_state_loaded(precision: str, offload: bool, checkpoint: str) -> dict | None:
    """A fresh engine (this pool's world size, `offload`) loads `checkpoint`; rank 0 returns the
    whole state."""
    engine = _zero1(precision, offload)
    engine.load(Path(checkpoint))
    state = _whole_state(engine)
    engine.close()
    return state
