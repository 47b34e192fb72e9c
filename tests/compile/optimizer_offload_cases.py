"""What the optimizer-offload tests run on every rank: optimizer steps through the real engines
(DeepSpeed ZeRO-1 with ZeRO-Offload, FSDP2 with CPUOffloadPolicy) with the optimizer state in
host memory or not, and a save and resume in the middle. Batches, backends and the engines'
job config come from train_cases, so these cases share the pools' compiled graphs."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from sp_cases import backend_for, contiguous_sp_group
from train_cases import _engine, _job_config, _whole_weights, take_steps

from slurm_autosp.compile import compile_model
from slurm_autosp.config import LoraConfig
from slurm_autosp.sp import set_sp_group


def _offloaded(engine) -> bool:
    """Whether the engine really keeps its optimizer state on the host and steps it there."""
    if engine.name == "deepspeed_zero1":
        inner = engine._engine
        return inner.zero_cpu_offload() and inner.optimizer.optimizer.defaults["fused"]
    state = engine.module._get_fsdp_state()._fsdp_param_group
    policy = type(state.offload_policy).__name__
    return policy == "CPUOffloadPolicy" and engine.optimizer.defaults["fused"]


def _full_grads(engine) -> dict[str, torch.Tensor]:
    """Every parameter's whole reduced gradient before the optimizer step (collective)."""
    trained = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    if engine.name == "fsdp2":
        return {name: p.grad.full_tensor() for name, p in trained}
    from deepspeed.utils import safe_get_full_grad

    return {name: safe_get_full_grad(p).clone() for name, p in trained}


def offload_steps(
    zero_stage: int,
    sp_size: int,
    grad_accum: int,
    steps: int,
    offload: bool,
    checkpoint: str | None = None,
    lora: bool = False,
) -> dict | None:
    """`steps` optimizer steps on SP x DP ranks; with `checkpoint`, the engine saves there after
    the first step and a new engine loads it and takes the rest. Rank 0 returns the step losses
    and gradient norms, the first step's whole gradients, the initial and final whole weights,
    and whether the optimizer state was offloaded. `lora`: LoRA adapters train, the rest
    frozen."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # one machine: local rank = rank
    cfg = _job_config(dist.get_world_size(), zero_stage, grad_accum, steps)
    cfg.model.lora = LoraConfig(rank=4, alpha=8) if lora else None
    engine = _engine(zero_stage, cfg, offload)
    initial = _whole_weights(engine)
    offloaded = _offloaded(engine)
    compile_model(engine.module, backend_for(sp_size, True), per_layer=True)
    set_sp_group(contiguous_sp_group(sp_size))
    first_grads: dict[str, torch.Tensor] = {}

    def keep_first_grads(micro: int) -> None:
        if not first_grads and micro == grad_accum - 1:
            first_grads.update(_full_grads(engine))

    before_save = range(1 if checkpoint else steps)
    losses, grad_norms = take_steps(
        engine, before_save, sp_size, grad_accum, after_backward=keep_first_grads
    )
    if checkpoint:
        engine.state_files().write(Path(checkpoint))
        engine.close()
        engine = _engine(zero_stage, cfg, offload)
        engine.load(Path(checkpoint))
        compile_model(engine.module, backend_for(sp_size, True), per_layer=True)
        more_losses, more_norms = take_steps(engine, range(1, steps), sp_size, grad_accum)
        losses, grad_norms = losses + more_losses, grad_norms + more_norms
    weights = _whole_weights(engine)
    engine.close()
    if dist.get_rank() != 0:
        return None
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "grads": first_grads,
        "initial": initial,
        "weights": weights,
        "offloaded": offloaded,
    }
