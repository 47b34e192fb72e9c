"""FSDP2 parameter sharding (`parallel.zero_stage=3`): parameters, gradients and optimizer
state sharded over every rank, for models no single GPU can hold whole.

One `fully_shard` per decoder layer and one at the root, before AutoSP compiles each layer:
FSDP2's all-gathers and reduce-scatters run in its hooks, outside the compiled graphs, so one
graph still serves every layer (docs/sharding_spike.md). The optimizer is plain AdamW over the
local fp32 shards; bf16 runs compute in bf16 and reduce gradients in fp32.

A LoRA model's frozen base is sharded in the compute dtype, its adapters in fp32 with their
gradients and Adam's moments; checkpoints leave the base out.

Optimizer offload is torch's `CPUOffloadPolicy`: the fp32 shards, their gradients and Adam's
moments live in host memory, each layer's shards are copied to the GPU for its all-gather and
its reduced gradients back, and the AdamW step (fused) runs on the host's CPU.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from slurm_autosp.checkpoint.export import distinct_tensors, every_name
from slurm_autosp.checkpoint.state_files import StateFiles
from slurm_autosp.compat.torch_api import clear_sharding_prop_cache
from slurm_autosp.compile import AutoSPCompileError, decoder_layers
from slurm_autosp.config import ConfigError, JobConfig
from slurm_autosp.lora import base_weights, has_adapters
from slurm_autosp.model import compute_dtype
from slurm_autosp.optim import (
    apply_hyperparameters,
    build_lr_scheduler,
    build_optimizer,
    fused_kernel,
)
from slurm_autosp.sp import loss_scale

SCHEDULE_FILE = "schedule.pt"


class FSDP2Engine:
    name = "fsdp2"

    def __init__(
        self,
        model: nn.Module,
        cfg: JobConfig,
        device: torch.device,
        offload_optimizer: bool = False,
    ):
        world = dist.get_world_size()
        # DTensor's sharding caches live as long as the process and take a cached mesh for an
        # equal one (same ranks, whatever its process group): sharded without this, parameters
        # may carry the mesh of an engine over an earlier, destroyed group (a start check's),
        # whose group name now resolves to nothing or to another group
        clear_sharding_prop_cache()
        mesh = init_device_mesh(device.type, (world,))
        self._device = device
        self._compute_dtype = compute_dtype(cfg.precision)
        policy = MixedPrecisionPolicy(param_dtype=self._compute_dtype, reduce_dtype=torch.float32)
        # pinned host memory needs an accelerator; on CPU ranks the copies are no-ops anyway
        offload = (
            CPUOffloadPolicy(pin_memory=device.type != "cpu")
            if offload_optimizer
            else OffloadPolicy()
        )
        if has_adapters(model):
            _frozen_in(model, self._compute_dtype)
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
        if any(p.is_meta for p in model.parameters()):
            materialize(model, device, torch.device("cpu") if offload_optimizer else device)
        # HF returns its logits as a slice of the hidden states (a view); the loss only reads
        # it, never in place, which is what FSDP2 warns about on every forward
        warnings.filterwarnings(
            "ignore", r"FSDP2-wrapped module .* returned a view tensor", UserWarning
        )
        self.module = model
        self._fused = fused_kernel(cfg.cluster, offload_optimizer)
        self.optimizer = build_optimizer(model, cfg.train, fused=self._fused)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.train)
        self._train = cfg.train
        self.loss_scale = loss_scale(world, cfg.train.grad_accum, averages_micro_batches=False)
        self._grad_accum = cfg.train.grad_accum
        self._max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
        self._micro_steps = 0  # saves happen at step boundaries, where this is 0 mod grad_accum
        self._grad_norm = 0.0
        adapters = has_adapters(model)  # the base stays out of checkpoints, and loads without
        self._state_options = StateDictOptions(ignore_frozen_params=adapters, strict=not adapters)

    def __call__(self, **kwargs: Any) -> Any:
        return self.module(**kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self._micro_steps += 1
        if self._micro_steps % self._grad_accum:
            return
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = _global_norm([p.grad for p in params if p.grad is not None], self._device)
        torch.nn.utils.clip_grads_with_norm_(params, self._max_norm, norm)
        self._grad_norm = float(norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def abandon_step(self) -> None:
        """Reshard what the step left gathered: checkpoints hold sharded parameters only."""
        reset = getattr(self.module, "reset_iter_state", None)
        if reset is not None:  # torch >= 2.13: also waits for collectives in flight
            reset()
        else:
            for module in self.module.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        self.optimizer.zero_grad(set_to_none=True)
        self._micro_steps -= self._micro_steps % self._grad_accum

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def grad_norm(self) -> float:
        return self._grad_norm

    def state_files(self) -> StateFiles:
        """Each rank's own shards (a torch distributed checkpoint), rank 0's also the schedule.
        The checkpoint records each tensor's whole shape, and `load` reads every rank's slice
        of it: another world size or layout resumes it. A LoRA model's frozen base is left out:
        every start reads it from its checkpoint."""
        model_state, optim_state = self._state()
        files = StateFiles(distributed={"": {"model": model_state, "optimizer": optim_state}})
        if dist.get_rank() == 0:
            files.trees[SCHEDULE_FILE] = self.scheduler.state_dict()
        return files

    def _state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimizer's state as checkpoints hold them: a LoRA model's
        without its frozen base (torch leaves out a frozen weight under one name only: a tied
        lm_head stays, which is left out here)."""
        model_state, optim_state = get_state_dict(
            self.module, self.optimizer, options=self._state_options
        )
        base = base_weights(self.module)
        return {k: v for k, v in model_state.items() if k not in base}, optim_state

    def load(self, path: Path) -> None:
        model_state, optim_state = self._state()
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))
        set_state_dict(  # dcp.load filled these dicts in place
            self.module,
            self.optimizer,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
            options=self._state_options,
        )
        self.scheduler.load_state_dict(
            torch.load(path / SCHEDULE_FILE, weights_only=True, map_location="cpu")
        )
        apply_hyperparameters(self.optimizer, self.scheduler, self._train, self._fused)

    def full_state_dict(
        self, keep: Callable[[str], bool] = every_name
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor `keep` keeps gathered from every rank's shard when it is taken (tied
        parameters once, in the same order on every rank) and cast to the compute dtype (bf16
        runs export bf16, as DeepSpeed's module does) before rank 0 copies it to its host."""
        rank0 = dist.get_rank() == 0
        for name, tensor in distinct_tensors(self.module):
            if not keep(name):
                continue
            whole = _gathered(tensor, self._device) if isinstance(tensor, DTensor) else tensor
            if rank0:
                yield name, whole.detach().to(self._compute_dtype).cpu()

    def load_full_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Collective: rank 0's whole-model `weights` (a pretrained checkpoint) into every
        rank's shards; the other ranks pass an empty dict."""
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.module, {**weights}, options=options)

    def close(self) -> None:
        """Nothing to release: the process group belongs to the job."""


def _gathered(shard: DTensor, device: torch.device) -> torch.Tensor:
    """The whole tensor, all-gathered where the mesh communicates: an offloaded shard lives in
    host memory, and NCCL gathers device tensors only (as torch's own state-dict gatherer does)."""
    if shard.device.type == shard.device_mesh.device_type:
        return shard.full_tensor()
    moved = shard.to(device)
    assert isinstance(moved, DTensor)
    return moved.full_tensor()


def _global_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The L2 norm of the whole model's gradient from every rank's shards, reduced on `device`:
    offloaded shards are host tensors, and NCCL reduces device tensors only."""
    local = torch.nn.utils.get_total_norm(
        [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    )
    squares = local.to(device, torch.float32).square()
    dist.all_reduce(squares)
    return squares.sqrt()


@torch.no_grad()
def _frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """A LoRA model's frozen base sharded in the compute dtype (bf16 on GPUs): it has no
    optimizer step to keep fp32 for, and FSDP2 gathers it in that dtype anyway. FSDP2 needs one
    dtype among a group's trained parameters only; the adapters stay fp32."""
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(dtype)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    try:
        return decoder_layers(model)
    except AutoSPCompileError as err:
        raise ConfigError(
            f"parameter sharding (parallel.zero_stage=3) shards each decoder layer, and none were found "
            f"in {type(model).__name__}: give the model a `_no_split_modules` list naming its layer class, "
            "or train it with parallel.zero_stage=1"
        ) from err


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, shard_device: torch.device) -> None:
    """Allocate a model built on the meta device and sharded, and initialize it as a whole:
    its shards on `shard_device` (the host under CPU offload), its buffers on `device`.

    Random init of a DTensor shard is not the slice of a whole-tensor init on every device
    (on CPU each rank draws the same values for its shard). So each module's parameters are
    drawn whole, by the model's own init on every rank from the same seed, and each rank keeps
    its slice; only one module's weights exist whole at a time. Buffers (rotary frequencies)
    are recomputed by the same init.
    """
    model.to_empty(device=shard_device)
    init = getattr(model, "_init_weights", None)
    if init is None:
        raise ValueError(
            f"{type(model).__name__} has no _init_weights: build it on a real device "
            "(model.builder) or from model.pretrained_path"
        )
    for module in _post_order(model):
        sharded = {
            name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)
        }
        for name, p in sharded.items():
            module._parameters[name] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device=device)
            )
        init(module)
        for name, p in sharded.items():
            initialised = module._parameters[name]
            assert initialised is not None  # set above; init may replace it, never remove it
            _copy_slice(p, initialised.data)
            module._parameters[name] = p
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    """Children before parents: the order Hugging Face's `initialize_weights` uses."""
    for child in module.children():
        yield from _post_order(child)
    yield module


def _copy_slice(param: DTensor, whole: torch.Tensor) -> None:
    """This rank's piece of `whole`, cut as FSDP2 cuts it (torch.chunk on dim 0; trailing
    ranks of a short dimension get nothing)."""
    coordinate = param.device_mesh.get_local_rank()
    pieces = torch.chunk(whole, param.device_mesh.size(), dim=0)
    param.to_local().copy_(pieces[coordinate] if coordinate < len(pieces) else whole[:0])
