"""DeepSpeed ZeRO-1: optimizer state sharded over all ranks, sequence-parallel ones included;
every rank holds the whole model. The engine for models that fit one GPU whole. Its checkpoint
is engine.zero1_checkpoint's, which resumes on any world size and layout."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slurm_autosp.checkpoint.export import every_name, whole_weights
from slurm_autosp.checkpoint.state_files import StateFiles
from slurm_autosp.checkpoint.store import CheckpointError
from slurm_autosp.config import JobConfig, Precision
from slurm_autosp.engine import zero1_checkpoint
from slurm_autosp.optim import (
    apply_hyperparameters,
    build_lr_scheduler,
    build_optimizer,
    fused_kernel,
)
from slurm_autosp.sp.loss import loss_scale


def deepspeed_config(cfg: JobConfig, offload_optimizer: bool) -> dict[str, Any]:
    """DeepSpeed's config for this job.

    `sequence_parallel_size` is deliberately absent: DeepSpeed then treats every rank as
    data-parallel and averages gradients over the whole world, the reduction `loss_scale`
    undoes.

    `offload_optimizer`: DeepSpeed's ZeRO-Offload keeps each rank's partition (fp32 master
    weights, fp32 gradients, Adam's moments) in pinned host memory and steps it there, with our
    own torch AdamW (`fused`) rather than DeepSpeedCPUAdam, hence `zero_force_ds_cpu_optimizer`
    off: DeepSpeedCPUAdam is a JIT-built C++ op (105 s to build on a 2-core node, a compiler
    needed on every node's image) and was slower than torch's fused CPU AdamW on the same cores
    (0.74 vs 1.15 G parameters/s), while torch's keeps one optimizer, one state layout and one
    set of hyperparameters across engines, offloaded or not.
    """
    t = cfg.train
    zero: dict[str, Any] = {"stage": 1}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    bf16 = cfg.precision is Precision.bf16
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch * t.grad_accum * cfg.cluster.world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        # bf16 gradients accumulate over micro-batches and are averaged over ranks in fp32,
        # as FSDP2 reduces: in bf16 (DeepSpeed's default) a micro-batch's gradient below 2^-8
        # of the sum so far is lost. DeepSpeed then keeps an fp32 gradient of the whole model
        # on every rank (its BF16_Optimizer, which adds each bf16 gradient in as backward
        # produces it and frees it: `immediate_grad_update`; under offload, an fp32
        # accumulator per parameter).
        "bf16": {"enabled": bf16, **({"immediate_grad_update": True} if bf16 else {})},
        **(
            {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}
            if bf16
            else {}
        ),
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


class ZeRO1Engine:
    name = "deepspeed_zero1"

    def __init__(self, model: nn.Module, cfg: JobConfig, offload_optimizer: bool = False):
        import deepspeed

        from slurm_autosp.compat.deepspeed_api import ZeroPartition, skip_shared_memory_comm_build

        skip_shared_memory_comm_build()
        self._fused = fused_kernel(cfg.cluster, offload_optimizer)
        optimizer = build_optimizer(model, cfg.train, fused=self._fused)
        self._engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=build_lr_scheduler(optimizer, cfg.train),
            config=deepspeed_config(cfg, offload_optimizer),
        )
        self.module = self._engine.module
        self._partition = ZeroPartition(self._engine.optimizer)
        self._train = cfg.train
        self.loss_scale = loss_scale(cfg.cluster.world_size, cfg.train.grad_accum)

    def __call__(self, **kwargs: Any) -> Any:
        return self._engine(**kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self._engine.backward(loss)

    def step(self) -> None:
        self._engine.step()

    def abandon_step(self) -> None:
        """ZeRO-1 reduces gradients in `step`, so a step left before it issued no reduction."""
        self._engine.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return self._engine.get_lr()[0]

    def grad_norm(self) -> float:
        return float(self._engine.get_global_grad_norm() or 0.0)

    def state_files(self) -> StateFiles:
        return zero1_checkpoint.state_files(self.module, self._partition, self._engine.lr_scheduler)

    def load(self, path: Path) -> None:
        if zero1_checkpoint.is_saved(path):
            zero1_checkpoint.load(path, self.module, self._partition, self._engine.lr_scheduler)
        else:
            self._load_own_format(path)
        apply_hyperparameters(
            self._engine.optimizer, self._engine.lr_scheduler, self._train, self._fused
        )

    def _load_own_format(self, path: Path) -> None:
        """A checkpoint in DeepSpeed's own format, written before zero1_checkpoint's: one flat
        optimizer slice a rank, so it loads on as many ranks as wrote it."""
        written_by = self._partition.own_format_ranks(path)
        if written_by != dist.get_world_size():
            raise CheckpointError(
                f"checkpoint {path} is in DeepSpeed's own format (written before checkpoints "
                f"resumed on another layout) by {written_by} ranks, and loads on {written_by} "
                f"ranks only; this job has {dist.get_world_size()}: resume it with the "
                "cluster.nodes and GPUs per node it was written with"
            )
        _, client_state = self._engine.load_checkpoint(str(path.parent), tag=path.name)
        if client_state is None:
            raise CheckpointError(f"DeepSpeed could not load its checkpoint {path}")

    def full_state_dict(
        self, keep: Callable[[str], bool] = every_name
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank's module holds the whole weights: rank 0 copies them from its GPU one
        tensor at a time."""
        return whole_weights(self.module, keep) if dist.get_rank() == 0 else iter(())

    def close(self) -> None:
        self._engine.destroy()
