"""DeepSpeed ZeRO-1 in bf16 accumulates micro-batch gradients and reduces them in fp32, as
FSDP2 does: in bf16 (DeepSpeed's default) a micro-batch's gradient below 2^-8 of the sum so far
is lost. One rank of the real engine (bf16 on CPU ranks is for tests only: the config refuses
it), its optimizer state resident and offloaded."""

import os

import torch
from deepspeed.utils import safe_get_full_grad

from slurm_autosp.config import Precision, load_config
from slurm_autosp.engine import build_engine

os.environ.setdefault("DS_ACCELERATOR", "cpu")

MICRO_GRADIENTS = [
    1.0,
    2**-9,
    2**-9,
    2**-9,
]  # each parameter's gradient, micro-batch by micro-batch


def bf16_engine(offload: bool):
    cfg = load_config(
        [
            "cluster.tasks_per_node=1",
            f"train.grad_accum={len(MICRO_GRADIENTS)}",
            "train.grad_clip=0",
            "model.num_hidden_layers=1",
        ]
    )
    cfg.train.precision = Precision.bf16
    engine = build_engine(cfg, torch.device("cpu"), zero_stage=1, offload_optimizer=offload)
    assert next(engine.module.parameters()).dtype == torch.bfloat16  # built in bf16
    return engine


def micro_batch(engine, gradient: float) -> None:
    """A forward through the engine (its hooks) and a backward giving every parameter
    `gradient` (times the engine's factor)."""
    logits = engine(input_ids=torch.ones(1, 8, dtype=torch.long)).logits
    weights = sum(p.float().sum() for p in engine.module.parameters())
    engine.backward((logits.float().sum() * 0 + weights * gradient) * engine.loss_scale)


def expected(engine, gradients) -> float:
    """The micro-batches' gradients summed in fp32, times the engine's factor and DeepSpeed's
    1/grad_accum."""
    return sum(gradients) * engine.loss_scale / len(MICRO_GRADIENTS)


def test_bf16_gradients_accumulate_and_reduce_in_fp32(single_rank_group):
    engine = bf16_engine(offload=False)
    embedding = engine.module.get_input_embeddings().weight
    for gradient in MICRO_GRADIENTS:
        micro_batch(engine, gradient)
        assert embedding.grad is None  # added into the fp32 gradient and freed: 4, not 6, B/param
        if gradient is not MICRO_GRADIENTS[-1]:
            engine.step()
    reduced = safe_get_full_grad(embedding)
    assert reduced.dtype == torch.float32
    assert torch.all(reduced == expected(engine, MICRO_GRADIENTS)), reduced.flatten()[:4]
    engine.step()


def test_bf16_gradients_accumulate_in_fp32_with_the_optimizer_offloaded(single_rank_group):
    """ZeRO-Offload keeps an fp32 accumulator on each bf16 parameter (`grad_accum`) until the
    last micro-batch reduces it into the host's fp32 partition."""
    engine = bf16_engine(offload=True)
    for gradient in MICRO_GRADIENTS[:-1]:
        micro_batch(engine, gradient)
        engine.step()
    accumulated = getattr(engine.module.get_input_embeddings().weight, "grad_accum", None)
    assert accumulated is not None and accumulated.dtype == torch.float32
    assert torch.all(accumulated == expected(engine, MICRO_GRADIENTS[:-1]))
    micro_batch(engine, MICRO_GRADIENTS[-1])
    engine.step()
