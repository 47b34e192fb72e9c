"""Exactness of the memory-saving rewrites on this device at SP=1, in bf16 against an fp32
reference: tiled vs untiled (MLP tiles, and whole tiled layers under `full`), offloaded vs
resident activations.

A bf16 step cannot equal an fp32 one, nor two bf16 steps summed in different orders equal each
other bitwise, so each variant is held to the untiled, resident bf16 step compiled the same way
(the baseline), the way flash attention's tests hold their kernel to the framework's own: its
error against the fp32 reference may be at most FACTOR times the baseline's, plus FLOOR for a
baseline that happens to be almost exact. The error of a step is the worse of its loss's
relative error and its gradients' (the worst parameter's max |g - g_ref| / max |g_ref|): a tile
left out, a race on the offload's side stream or a stale prefetch shows in both.

The model is a small Llama with the head size of the real ones (128), compiled per layer with
the AutoSP backend as training compiles it; `tiny` shrinks it and `compiled=False` runs it
eagerly, for a CPU self-test of this code rather than of the compiled kernels.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from slurm_autosp.compile import AutoSPBackend, compile_model, tile_layers, tile_mlps
from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.config import ActivationCheckpointing, ModelConfig
from slurm_autosp.model import build_model
from slurm_autosp.probe.kernels import FAIL, PASS, KernelCheck
from slurm_autosp.run_step import run_module_step
from slurm_autosp.sp import prepare_sp_inputs
from slurm_autosp.sp.offload import ActivationOffload
from slurm_autosp.verify.ranks import full_fp32

FACTOR = 2.0
FLOOR = 1e-3


@dataclass(frozen=True)
class Shape:
    """The model and batch the checks run on."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    layers: int
    vocab: int
    seq: int
    tile_tokens: int  # tiles of the tiled variants: several per sequence, the last one short


GPU_SHAPE = Shape(1024, 8, 2, 3584, 2, 8192, 2048, 384)
TINY_SHAPE = Shape(64, 4, 2, 128, 2, 256, 256, 48)


@dataclass(frozen=True)
class _Step:
    loss: float
    grads: dict[str, torch.Tensor]  # fp32, on the host


def _model(shape: Shape) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(
        ModelConfig(
            vocab_size=shape.vocab,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
        )
    )


def _step(
    model: torch.nn.Module, input_ids: torch.Tensor, offload: ActivationOffload | None = None
) -> _Step:
    batch = prepare_sp_inputs(input_ids, sp_rank=0, sp_size=1)
    saving = offload.saving if offload else nullcontext
    (step,) = run_module_step(model, [batch], sp_size=1, saving=saving).micro_batches
    loss = step.loss
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return _Step(float(loss.detach()), grads)


def _error(step: _Step, reference: _Step) -> float:
    loss = abs(step.loss - reference.loss) / abs(reference.loss)
    grads = max(
        float((step.grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30))
        for n, g in reference.grads.items()
    )
    return max(loss, grads)


def _bf16(
    reference: torch.nn.Module,
    device: torch.device,
    backend: AutoSPBackend | None,
    tile_tokens: int,
    policy: ActivationCheckpointing,
) -> torch.nn.Module:
    """The reference's weights in bf16, compiled by `backend` (None: eager), tiled as training
    tiles under `policy`: whole layers under `full`, else the MLPs."""
    model = copy.deepcopy(reference).to(device=device, dtype=torch.bfloat16)
    if backend is not None:
        compile_model(model, backend, per_layer=True, tile_tokens=tile_tokens)
    elif tile_tokens and policy is ActivationCheckpointing.full:
        tile_layers(model, tile_tokens)
    elif tile_tokens:
        tile_mlps(model, tile_tokens)
    return model


def check_rewrites(device: torch.device, tiny: bool, compiled: bool = True) -> list[KernelCheck]:
    """Tiled MLPs, tiled layers and offloaded activations, each against its untiled, resident
    baseline. The SP group (one rank) must be registered: the AutoSP graph's all-to-all
    runs over it."""
    shape = TINY_SHAPE if tiny else GPU_SHAPE
    reference = _model(shape)
    input_ids = torch.randint(
        1, shape.vocab, (1, shape.seq), generator=torch.Generator().manual_seed(1)
    ).to(device)
    with full_fp32():
        exact = _step(copy.deepcopy(reference).to(device), input_ids)
    rows = []
    baselines: dict[ActivationCheckpointing, float] = {}
    backends: dict[ActivationCheckpointing, AutoSPBackend | None] = {}
    for name, policy, tiles, offloaded in (
        ("tiled MLPs vs untiled", ActivationCheckpointing.none, shape.tile_tokens, False),
        ("tiled layers vs untiled (full)", ActivationCheckpointing.full, shape.tile_tokens, False),
        ("offloaded vs resident activations", ActivationCheckpointing.none, 0, True),
    ):
        backend = backends.setdefault(
            policy, AutoSPBackend(1, ActivationCheckpointSpec(policy)) if compiled else None
        )
        if policy not in baselines:
            baseline = _step(_bf16(reference, device, backend, 0, policy), input_ids)
            baselines[policy] = _error(baseline, exact)
        offload = ActivationOffload(device, layers=shape.layers, min_bytes=0) if offloaded else None
        step = _step(_bf16(reference, device, backend, tiles, policy), input_ids, offload)
        error, tolerance = _error(step, exact), FACTOR * baselines[policy] + FLOOR
        detail = (
            f"bf16 vs fp32, the worse of loss and gradients; untiled resident bf16: "
            f"{baselines[policy]:.2e}; {shape.layers} layers, hidden {shape.hidden}, "
            f"{shape.seq} tokens"
            + (f", tiles of {tiles}" if tiles else "")
            + ("" if compiled else ", eager")
        )
        rows.append(
            KernelCheck(name, PASS if error <= tolerance else FAIL, error, tolerance, detail)
        )
    return rows
