"""What every rank runs in the sharding spike: one SP=2 step of a per-layer AutoSP-compiled tiny
Llama inside a parameter-sharding engine (DeepSpeed ZeRO-3 or FSDP2), compared
with a single-device fp32 reference computed on the same rank.

The SP group is the whole world, and the engine's data-parallel (sharding) group is the same
ranks: each rank holds one half of the sequence and one half of every parameter.
Each rank's loss is its summed token loss over the step's global count of valid labels; the sum
of those over the ranks is the single-device loss. The engine then reduces gradients its own way,
and `engine_loss_scale` is the factor that turns that reduction back into the sum.
"""

import os

import torch
import torch.distributed as dist
from sp_cases import Case, make_batch, reference_step, tiny_model

from slurm_autosp.compile import (
    AutoSPBackend,
    compile_model,
    decoder_layers,
    prepare_sp_inputs,
    set_sp_group,
)

_backends: dict[str, AutoSPBackend] = {}


class GraphCounter(AutoSPBackend):
    """The AutoSP backend, also counting the graphs Dynamo hands it (graph breaks make more)."""

    def __init__(self, sp_size: int) -> None:
        super().__init__(sp_size)
        self.graphs = 0
        self.collectives_in_graphs: set[str] = set()

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.collectives_in_graphs |= {
            str(n.target)
            for n in gm.graph.nodes
            if n.op == "call_function"
            and any(w in str(n.target) for w in ("all_gather", "reduce_scatter", "fsdp"))
        }
        return super().__call__(gm, example_inputs)


def engine_loss_scale(engine: str, world_size: int, grad_accum: int) -> float:
    """The factor on each rank's loss (local token-loss sum / the step's global valid-label count)
    that makes the engine's reduced gradient the single-device gradient of the whole step.

    DeepSpeed, ZeRO-1 and ZeRO-3 alike when configured without `sequence_parallel_size`, averages
    gradients over all ranks and divides each micro-batch's loss by the accumulation steps:
    world * grad_accum. FSDP2 divides the reduce-scattered gradient by its mesh size (here the
    world) and sums micro-batches without dividing: world, whatever grad_accum is.
    (`set_gradient_divide_factor(1.0)` would make the factor 1, but it reduces with
    ReduceOp.PREMUL_SUM, which gloo refuses.)
    """
    if engine == "fsdp2":
        return float(world_size)
    return float(world_size * grad_accum)


def _zero3_engine(model: torch.nn.Module, grad_accum: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _full_grads_deepspeed(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad

    return {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}


def _fsdp2_model(model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    """Shard every decoder layer, then the rest (embeddings, norm, lm_head) at the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def sharded_sp_step(engine: str, case: Case, grad_accum: int = 1) -> dict[str, object]:
    """One optimizer step's forward and backward under `engine`, SP over the whole world, the
    batch's rows taken as `grad_accum` micro-batches; errors vs the single-device full batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = make_batch(case)
    ref_loss, _, ref_grads = reference_step(case, batch)

    rows = case.batch // grad_accum
    shards = [
        prepare_sp_inputs(
            **{k: v[m * rows : (m + 1) * rows] for k, v in batch.items()},
            sp_rank=rank,
            sp_size=world,
        )
        for m in range(grad_accum)
    ]
    count = torch.tensor(sum(shard.valid_labels for shard in shards))
    dist.all_reduce(count)  # the whole step's normaliser: every rank, every micro-batch

    backend = _backends.setdefault(engine, GraphCounter(world))
    graphs_before = backend.graphs
    model = tiny_model(case.family, case.kv_heads)
    if engine == "fsdp2":
        _fsdp2_model(model, decoder_layers(model))
    compile_model(model, backend, per_layer=case.per_layer)
    set_sp_group(dist.group.WORLD)
    scale = engine_loss_scale(engine, world, grad_accum)
    loss = torch.zeros(())
    if engine == "fsdp2":
        for shard in shards:
            out = model(**shard.model_kwargs(count))
            (out.loss * scale).backward()
            loss += out.loss.detach()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    else:
        wrapped = _zero3_engine(model, grad_accum=grad_accum)
        for micro, shard in enumerate(shards):
            out = wrapped(**shard.model_kwargs(count))
            wrapped.backward(out.loss * scale)  # DeepSpeed divides by grad_accum here
            loss += out.loss.detach()
            if micro < grad_accum - 1:
                wrapped.step()  # only counts the micro-step: the optimizer steps at the boundary
        grads = _full_grads_deepspeed(wrapped)
    backend.require_sdpa_found()

    dist.all_reduce(loss)
    grad_error = max(
        float((grads[name] - reference).abs().max() / reference.abs().max())
        for name, reference in ref_grads.items()
    )
    return {
        "loss_rel_error": float((loss - ref_loss).abs() / ref_loss.abs()),
        "grad_rel_error": grad_error,
        "graphs_compiled": backend.graphs - graphs_before,
        "collectives_in_graphs": sorted(backend.collectives_in_graphs),
        "finite": bool(torch.isfinite(loss)),
    }
