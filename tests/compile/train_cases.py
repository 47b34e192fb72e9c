"""What every rank runs in the training-equivalence tests: whole optimizer steps (gradient
accumulation, the real engines: DeepSpeed ZeRO-1 and FSDP2 parameter sharding, bf16) against a single-device reference.

The reference runs on rank 0 only (the other ranks would compute the same numbers); each
function returns rank 0's figures, None on the other ranks. Backends and SP groups come from
sp_cases, so these cases share the pools' compiled graphs and caches with the SP tests.
"""

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pool_dims import pool_dims
from sp_cases import (
    VOCAB,
    backend_for,
    contiguous_sp_group,
    register_sp_groups,
    tiny_model,
)
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from slurm_autosp.checkpoint.export import export_hf
from slurm_autosp.compile import compile_model
from slurm_autosp.config import LoraConfig
from slurm_autosp.data import TokenFileSource
from slurm_autosp.engine import FSDP2Engine, ZeRO1Engine
from slurm_autosp.engine.zero1_checkpoint import MODULE_FILE
from slurm_autosp.evaluate import Evaluator
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lora import add_adapters
from slurm_autosp.sp import IGNORE_INDEX, loss_scale, prepare_sp_inputs, set_sp_group
from slurm_autosp.sp.chunked_loss import causal_lm_loss
from slurm_autosp.verify import make_batch

SEQ = 127  # not divisible by 2 or 4: exercises the SP padding
LOSS_CHUNK = 24  # tokens per cross-entropy chunk in the engine steps: several chunks per rank


def _shift(labels: torch.Tensor) -> torch.Tensor:
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


def _micro_batches(batch: dict, dp_size: int, dp_rank: int, grad_accum: int) -> list[dict]:
    """Global batch row m * dp_size + dp_rank is this rank's micro-batch m (one row each)."""
    return [
        {
            key: value[m * dp_size + dp_rank : m * dp_size + dp_rank + 1]
            for key, value in batch.items()
        }
        for m in range(grad_accum)
    ]


def _sp_shards(
    batch: dict, sp_size: int, grad_accum: int, ring_size: int = 1
) -> tuple[list, torch.Tensor]:
    """This rank's SP shards of its micro-batches, and the step's global valid-label count."""
    rank = dist.get_rank()
    dp_size = dist.get_world_size() // sp_size
    shards = [
        prepare_sp_inputs(**micro, sp_rank=rank % sp_size, sp_size=sp_size, ring_size=ring_size)
        for micro in _micro_batches(batch, dp_size, rank // sp_size, grad_accum)
    ]
    count = torch.tensor(sum(shard.valid_labels for shard in shards))
    dist.all_reduce(count)
    return shards, count


def _kwargs(shard, count: torch.Tensor) -> dict:
    kwargs = shard.model_kwargs(count)
    for name in ("input_ids", "position_ids", "shift_labels"):
        torch._dynamo.mark_dynamic(kwargs[name], 1)
    return kwargs


def _grad_error(grad: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative to the reference's largest; a gradient that is zero (LoRA's A while B is) must
    be zero."""
    return float((grad - reference).abs().max() / reference.abs().max().clamp(min=1e-30))


def grad_accum_step(sp_size: int, grad_accum: int, ring_size: int = 1) -> dict | None:
    """One optimizer step of grad_accum micro-batches on SP x DP ranks (SP = ulysses x
    `ring_size`), reduced as DeepSpeed does (each backward divided by grad_accum, summed over
    micro-steps, averaged over the world), against one single-device batch holding every
    sequence of the step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = world // sp_size * grad_accum
    batch = make_batch(rows, SEQ, VOCAB, seed=11)
    shards, count = _sp_shards(batch, sp_size, grad_accum, ring_size)

    model = tiny_model("llama", 2)
    # the graph zero1_steps reuses
    compile_model(model, backend_for(sp_size, True, ring_size), per_layer=True)
    register_sp_groups(sp_size, ring_size)
    step_loss = torch.zeros(())
    for shard in shards:
        loss = model(**_kwargs(shard, count)).loss
        (loss * loss_scale(world, grad_accum) / grad_accum).backward()
        step_loss += loss.detach()
    dist.all_reduce(step_loss)
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)
        grads[name] = param.grad / world
    if rank != 0:
        return None

    reference = tiny_model("llama", 2)
    ref_loss = reference(**batch, use_cache=False).loss
    ref_loss.backward()
    errors = {name: _grad_error(grads[name], p.grad) for name, p in reference.named_parameters()}
    return {
        "loss": float(step_loss),
        "loss_rel_error": float((step_loss - ref_loss.detach()).abs() / ref_loss.detach().abs()),
        "grad_rel_error": max(errors.values()),
        "worst_param": max(errors, key=errors.get),
        "valid_labels": int(count),
        "tokens": rows * SEQ,
    }


# ------------------------------------------------------------------ the real engines


def _job_config(world: int, zero_stage: int, grad_accum: int, steps: int):
    from slurm_autosp.config import JobConfig, LrSchedule

    cfg = JobConfig()
    cfg.cluster.tasks_per_node = world  # DeepSpeed's train_batch_size counts the whole world
    cfg.parallel.zero_stage = zero_stage
    t = cfg.train
    t.steps, t.micro_batch, t.grad_accum = steps, 1, grad_accum
    t.lr, t.lr_schedule, t.warmup_steps, t.min_lr_ratio = 2e-3, LrSchedule.cosine, 1, 0.1
    t.betas, t.weight_decay, t.grad_clip = (
        [0.9, 0.95],
        0.1,
        0.5,
    )  # grad norms here are ~0.75: clipping engages
    return cfg


def _adapted_tiny(cfg):
    """The fixed-seed tiny model, with the adapters of `model.lora` if set."""
    built = tiny_model("llama", 2)
    return add_adapters(built, cfg.model.lora) if cfg.model.lora else built


def _engine(zero_stage: int, cfg, offload: bool = False):
    """ZeRO-1 over the fixed-seed tiny model; FSDP2 over the same model built on the meta
    device, so the engine's own sharded initialization is what gets trained; the optimizer
    state in host memory with `offload`. With `model.lora`, the model has its adapters; under
    FSDP2 rank 0's whole model is scattered into the shards, as build_engine does."""
    if zero_stage == 1:
        return ZeRO1Engine(_adapted_tiny(cfg), cfg, offload)
    whole = _adapted_tiny(cfg).state_dict() if cfg.model.lora and dist.get_rank() == 0 else {}
    with torch.device("meta"):
        skeleton = _adapted_tiny(cfg)
    engine = FSDP2Engine(skeleton, cfg, torch.device("cpu"), offload)
    if cfg.model.lora:
        engine.load_full_weights(whole)
    return engine


def _whole_weights(engine) -> dict:
    """The whole model's weights: gathered by a sharding engine, the module's own otherwise."""
    gathered = {k: v.clone() for k, v in engine.full_state_dict()}  # rank 0's
    return gathered or {k: v.clone() for k, v in engine.module.state_dict().items()}


def take_steps(
    engine,
    steps: range,
    sp_size: int,
    grad_accum: int,
    forward_context: Callable[[], AbstractContextManager] = nullcontext,
    after_backward: Callable[[int], None] = lambda micro: None,
    ring_size: int = 1,
) -> tuple[list[float], list[float]]:
    """Optimizer steps `steps` through `engine`, each of grad_accum micro-batches of its own
    seeded global batch (rows split over DP, sequences over SP); every forward runs under
    `forward_context()` and is followed by `after_backward(micro)` before the engine's step.
    Returns each step's global loss and the engine's gradient norms."""
    rows = dist.get_world_size() // sp_size * grad_accum
    losses, grad_norms = [], []
    for step in steps:
        batch = make_batch(rows, SEQ, VOCAB, seed=100 + step)
        shards, count = _sp_shards(batch, sp_size, grad_accum, ring_size)
        step_loss = torch.zeros(())
        for micro, shard in enumerate(shards):
            with forward_context():
                loss = causal_lm_loss(engine, _kwargs(shard, count), chunk_tokens=LOSS_CHUNK)
            engine.backward(loss * engine.loss_scale)
            after_backward(micro)
            engine.step()
            step_loss += loss.detach()
        dist.all_reduce(step_loss)
        losses.append(float(step_loss))
        grad_norms.append(engine.grad_norm())
    return losses, grad_norms


def engine_steps(
    zero_stage: int,
    sp_size: int,
    grad_accum: int,
    steps: int,
    ring_size: int = 1,
    lora: bool = False,
) -> dict | None:
    """`steps` optimizer steps through the engine for `zero_stage` (DeepSpeed ZeRO-1, or FSDP2
    parameter sharding; torch AdamW and our LR schedule in both) on SP x DP ranks, with the
    engine's own loss scale and the production chunked loss, against torch AdamW on one device
    from the same initial weights with the same lr schedule, betas, eps, weight decay and
    gradient clipping (DeepSpeed scales by clip / (norm + 1e-6) when the norm is above clip,
    which is torch's clip_grad_norm_). Under FSDP2 the first step's reduced gradients are
    compared too (DeepSpeed's are checked by grad_accum_step, whose reduction emulates it).
    `lora`: LoRA adapters on every projection train, the rest stays as it was."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # one machine: local rank = rank
    from slurm_autosp.optim import build_lr_scheduler, build_optimizer

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = _job_config(world, zero_stage, grad_accum, steps)
    if lora:
        cfg.model.lora = LoraConfig(rank=4, alpha=8)
        cfg.train.lr = 2e-2  # the adapters move enough in 3 steps to tell a wrong one
        cfg.train.grad_clip = 0.1  # the adapters' gradient norms are ~0.2: clipping engages
    rows = world // sp_size * grad_accum
    batches = [make_batch(rows, SEQ, VOCAB, seed=100 + step) for step in range(steps)]

    engine = _engine(zero_stage, cfg)
    initial = _whole_weights(engine)
    compile_model(engine.module, backend_for(sp_size, True, ring_size), per_layer=True)
    register_sp_groups(sp_size, ring_size)
    first_grads: dict[str, torch.Tensor] = {}

    def keep_first_grads(micro: int) -> None:
        if zero_stage == 3 and not first_grads and micro == grad_accum - 1:
            first_grads.update(
                {
                    name: p.grad.full_tensor()
                    for name, p in engine.module.named_parameters()
                    if p.requires_grad
                }
            )

    losses, grad_norms = take_steps(
        engine,
        range(steps),
        sp_size,
        grad_accum,
        after_backward=keep_first_grads,
        ring_size=ring_size,
    )
    params = _whole_weights(engine)
    engine.close()
    if rank != 0:
        return None

    reference = tiny_model("llama", 2)
    if cfg.model.lora:
        reference = add_adapters(reference, cfg.model.lora)
    reference.load_state_dict(initial)
    optimizer = build_optimizer(reference, cfg.train)
    scheduler = build_lr_scheduler(optimizer, cfg.train)
    ref_losses, ref_norms, grad_errors = [], [], {}
    for batch in batches:
        loss = reference(**batch, use_cache=False).loss
        loss.backward()
        if first_grads and not ref_losses:
            grad_errors = {
                name: _grad_error(first_grads[name], p.grad)
                for name, p in reference.named_parameters()
                if p.requires_grad
            }
        trained = [p for p in reference.parameters() if p.requires_grad]
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(trained, cfg.train.grad_clip)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ref_losses.append(float(loss.detach()))
    param_errors = {}
    frozen_moved = {}
    for name, p_ref in reference.named_parameters():
        if not p_ref.requires_grad:
            frozen_moved[name] = float((params[name] - initial[name]).abs().max())
            continue
        moved = (p_ref.detach() - initial[name]).abs().max()
        param_errors[name] = float((params[name] - p_ref.detach()).abs().max() / moved)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "loss_rel_errors": [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)],
        "grad_rel_error": max(grad_errors.values()) if grad_errors else None,
        "grad_norms": grad_norms,
        "ref_grad_norms": ref_norms,
        "grad_clip": cfg.train.grad_clip,
        "param_rel_error": max(param_errors.values()),
        "worst_param": max(param_errors, key=param_errors.get),
        "trained": sorted(param_errors),
        "frozen_moved": max(frozen_moved.values(), default=0.0),
        "frozen": len(frozen_moved),
    }


# ------------------------------------------------------------------ bf16


def _loss_per_token_grads(model, batch: dict) -> tuple[float, torch.Tensor, dict]:
    out = model(**batch, use_cache=False)
    out.loss.backward()
    logits = out.logits.detach().float().transpose(1, 2)
    per_token = F.cross_entropy(logits, _shift(batch["labels"]), reduction="none")
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    return float(out.loss.detach()), per_token, grads


def _bf16_model(
    zero_stage: int,
) -> tuple[torch.nn.Module, float, Callable[[torch.nn.Module], dict]]:
    """The SP model in bf16, the factor on its loss, and how to read its reduced fp32 gradients:
    the model cast to bf16 with gradients averaged over the world in fp32 (no engine), or FSDP2
    computing in bf16 over fp32 shards and reducing in fp32 (zero_stage=3)."""
    from slurm_autosp.config import Precision
    from slurm_autosp.engine import FSDP2Engine

    world = dist.get_world_size()
    if zero_stage == 3:
        cfg = _job_config(world, 3, 1, 1)
        cfg.train.precision = Precision.bf16
        engine = FSDP2Engine(tiny_model("llama", 2), cfg, torch.device("cpu"))
        return (
            engine.module,
            engine.loss_scale,
            lambda m: {n: p.grad.full_tensor() for n, p in m.named_parameters()},
        )

    def averaged(model: torch.nn.Module) -> dict:
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad.float()
            dist.all_reduce(grad)
            grads[name] = grad / world
        return grads

    return tiny_model("llama", 2).to(torch.bfloat16), loss_scale(world, grad_accum=1), averaged


def bf16_errors(sp_size: int, zero_stage: int = 1) -> dict | None:
    """Errors against the fp32 single-device reference, of single-device bf16 and of SP bf16
    (`_bf16_model`: the model cast to bf16, or FSDP2's bf16 compute with zero_stage=3).

    loss error: |L - L_fp32| / |L_fp32|. token error: root mean square over valid labels of the
    per-token loss difference. gradient error: ||g - g_fp32|| / ||g_fp32|| over all parameters
    as one vector; also the worst parameter's max|g - g_fp32| / max|g_fp32|.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = make_batch(2 * world // sp_size, SEQ, VOCAB, seed=23)
    rows_per_rank = 2
    dp_rank, sp_rank = rank // sp_size, rank % sp_size
    local = {
        key: value[dp_rank * rows_per_rank : (dp_rank + 1) * rows_per_rank]
        for key, value in batch.items()
    }
    shard = prepare_sp_inputs(**local, sp_rank=sp_rank, sp_size=sp_size)
    count = torch.tensor(shard.valid_labels)
    dist.all_reduce(count)

    model, scale, reduced_grads = _bf16_model(zero_stage)
    compile_model(model, backend_for(sp_size, True), per_layer=True)
    set_sp_group(contiguous_sp_group(sp_size))
    out = model(**_kwargs(shard, count))
    (out.loss * scale).backward()
    loss = out.loss.detach().float()
    dist.all_reduce(loss)
    per_token = F.cross_entropy(
        out.logits.detach().float().transpose(1, 2), shard.shift_labels, reduction="none"
    )
    gathered = [torch.empty_like(per_token) for _ in range(world)]
    dist.all_gather(gathered, per_token.contiguous())
    grads = reduced_grads(model)
    if rank != 0:
        return None

    sp_tokens = torch.cat(
        [
            torch.cat(gathered[d * sp_size : (d + 1) * sp_size], dim=1)
            for d in range(world // sp_size)
        ],
        dim=0,
    )[:, :SEQ]
    ref = _loss_per_token_grads(tiny_model("llama", 2), batch)
    single = _loss_per_token_grads(tiny_model("llama", 2).to(torch.bfloat16), batch)
    valid = _shift(batch["labels"]) != IGNORE_INDEX

    def errors(loss: float, tokens: torch.Tensor, grads: dict) -> dict:
        ref_loss, ref_tokens, ref_grads = ref
        diff = torch.cat([(grads[n] - g).flatten() for n, g in ref_grads.items()])
        norm = torch.cat([g.flatten() for g in ref_grads.values()])
        return {
            "loss": abs(loss - ref_loss) / abs(ref_loss),
            "token_rms": float((tokens - ref_tokens)[valid].pow(2).mean().sqrt()),
            "grad_norm": float(diff.norm() / norm.norm()),
            "grad_max": max(_grad_error(grads[n], g) for n, g in ref_grads.items()),
        }

    return {"single_bf16": errors(*single), "sp_bf16": errors(float(loss), sp_tokens, grads)}


# ------------------------------------------------------------------ sharded initialization


def sharded_init() -> dict | None:
    """What FSDP2Engine's meta-device build initializes, gathered to rank 0, next to a model
    built whole on CPU: the rotary frequencies and norms must be equal, the Linear weights drawn
    with the config's std, and the ranks' shards must differ (a per-shard draw from one seed
    would repeat the same rows on every rank)."""
    cfg = _job_config(dist.get_world_size(), 3, 1, 1)
    engine = _engine(3, cfg)
    weights = dict(engine.full_state_dict())
    rotary = engine.module.model.rotary_emb.inv_freq.clone()
    engine.close()
    if dist.get_rank() != 0:
        return None
    whole = tiny_model("llama", 2)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    half = q.shape[0] // 2
    return {
        "rotary_equal": torch.equal(rotary, whole.model.rotary_emb.inv_freq),
        "norms_one": all(
            torch.equal(v, torch.ones_like(v)) for k, v in weights.items() if "norm" in k
        ),
        "linear_std": float(q.std()),
        "config_std": whole.config.initializer_range,
        "shards_differ": not torch.equal(q[:half], q[half:]),
        "keys_equal": weights.keys() == whole.state_dict().keys(),
    }


def pretrained_under_fsdp2(path: str) -> dict | None:
    """A pretrained checkpoint under parameter sharding: rank 0 reads it, every rank keeps its
    shards; gathered back, the weights are the checkpoint's, and the rotary buffers are set."""
    from safetensors.torch import load_file

    from slurm_autosp.config import load_config
    from slurm_autosp.engine import build_engine

    cfg = load_config(
        [
            f"cluster.tasks_per_node={dist.get_world_size()}",
            "parallel.zero_stage=3",
            f"model.pretrained_path={path}",
        ]
    )
    engine = build_engine(cfg, torch.device("cpu"), 3)
    weights = dict(engine.full_state_dict())
    rotary = engine.module.model.rotary_emb.inv_freq.clone()
    engine.close()
    if dist.get_rank() != 0:
        return None
    saved = load_file(os.path.join(path, "model.safetensors"))
    return {
        "keys_equal": saved.keys() <= weights.keys(),
        "weights_equal": all(torch.equal(weights[name], tensor) for name, tensor in saved.items()),
        "rotary_equal": torch.equal(rotary, tiny_model("llama", 2).model.rotary_emb.inv_freq),
    }


def fsdp2_export(path: str, max_shard_bytes: int) -> dict | None:
    """FSDP2's Hugging Face export of a model with tied embeddings, streamed: every rank
    gathers each tensor with rank 0, which writes shards of at most `max_shard_bytes`. Loaded
    back with from_pretrained it gives the sharded model's logits."""
    from slurm_autosp.engine import FSDP2Engine

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    engine = FSDP2Engine(model, _job_config(dist.get_world_size(), 3, 1, 1), torch.device("cpu"))
    batch = make_batch(1, 32, VOCAB, seed=5)
    with torch.no_grad():
        logits = engine.module(input_ids=batch["input_ids"], use_cache=False).logits
    weights = engine.full_state_dict()
    if dist.get_rank() != 0:
        for _ in weights:
            pass
        engine.close()
        return None
    export_hf(engine.module, Path(path), weights, max_shard_bytes=max_shard_bytes)
    engine.close()
    hf = RunDir(Path(path)).hf_export
    loaded = AutoModelForCausalLM.from_pretrained(hf)
    with torch.no_grad():
        exported = loaded(input_ids=batch["input_ids"], use_cache=False).logits
    return {
        "files": sorted(p.name for p in hf.iterdir()),
        "logits_error": float((exported - logits).abs().max()),
        "tied": loaded.lm_head.weight is loaded.model.embed_tokens.weight,
        "architectures": loaded.config.architectures,
    }


def fsdp2_held_bytes() -> dict:
    """Bytes of weights, gradients and Adam state one rank holds under FSDP2 after an optimizer
    step (local shards only), against the parameter count: the memory plan's 16 B/param/world."""
    engine = _engine(3, _job_config(dist.get_world_size(), 3, 1, 1))
    batch = make_batch(1, 32, VOCAB, seed=5)
    engine.backward(engine(**batch, use_cache=False).loss)
    grads = sum(p.grad.to_local().nbytes for p in engine.module.parameters())
    engine.step()
    weights = sum(p.to_local().nbytes for p in engine.module.parameters())
    adam = sum(
        t.to_local().nbytes
        for s in engine.optimizer.state.values()
        for t in s.values()
        if t.dim() > 0
    )
    parameters = sum(p.numel() for p in engine.module.parameters())
    engine.close()
    return {"weights": weights, "grads": grads, "adam": adam, "parameters": parameters}


# ------------------------------------------------------------------ held-out evaluation

EVAL_SEQ = 61  # odd: the SP padding


def held_out_eval(
    path: str, sp_size: int, tile_tokens: int, micro_batch: int, samples: int, ring_size: int = 1
) -> dict | None:
    """Evaluator over the AutoSP-compiled model (MLPs tiled by `tile_tokens`) on SP x DP ranks
    (SP = Ulysses x `ring_size`), after a training forward and backward (the graphs then run
    again without grad), against the single-device loss of the same held-out samples; None on
    ranks other than 0."""
    rank = dist.get_rank()
    source = TokenFileSource(path, EVAL_SEQ, VOCAB)
    model = tiny_model("llama", 2)
    backend = backend_for(sp_size, True, ring_size)
    compile_model(model, backend, per_layer=True, tile_tokens=tile_tokens)
    register_sp_groups(sp_size, ring_size)
    shard = prepare_sp_inputs(
        source.sample(0).input_ids[None],
        sp_rank=rank % sp_size,
        sp_size=sp_size,
        ring_size=ring_size,
    )
    causal_lm_loss(model, shard.model_kwargs(torch.tensor(1)), chunk_tokens=LOSS_CHUNK).backward()
    evaluator = Evaluator(
        source=source,
        samples=samples,
        every=0,
        last_step=1,
        dims=pool_dims(sp_size, ring_size),
        micro_batch=micro_batch,
        chunk_tokens=LOSS_CHUNK,
    )
    result = evaluator.evaluate(model)
    if rank != 0:
        return None
    ids = torch.stack([source.sample(i).input_ids for i in range(samples)])
    with torch.no_grad():
        reference = tiny_model("llama", 2)(input_ids=ids, labels=ids, use_cache=False).loss
    return {
        "loss": result.loss,
        "ref_loss": float(reference),
        "rel_error": abs(result.loss - float(reference)) / float(reference),
        "tokens": result.tokens,
        "ref_tokens": samples * (EVAL_SEQ - 1),
        "still_training": model.training,
    }


def lora_bf16(zero_stage: int) -> dict | None:
    """Two SP=2 steps of a LoRA model computing in bf16 under the engine for `zero_stage`: the
    dtype of each parameter (FSDP2: of each shard), the losses and gradient norms, and the
    names of the weights its checkpoint holds (rank 0's)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    from slurm_autosp.config import Precision

    cfg = _job_config(dist.get_world_size(), zero_stage, 1, 2)
    cfg.train.precision = Precision.bf16  # on CPU ranks for tests only (the config refuses it)
    cfg.model.lora = LoraConfig(rank=4, alpha=8)
    if zero_stage == 1:  # as build_engine builds it: the model in the compute dtype
        engine = ZeRO1Engine(_adapted_tiny(cfg).to(torch.bfloat16), cfg)
    else:
        engine = _engine(zero_stage, cfg)
    dtypes = {name: p.dtype for name, p in engine.module.named_parameters()}
    compile_model(engine.module, backend_for(2, True), per_layer=True)
    register_sp_groups(2)
    losses, grad_norms = take_steps(engine, range(2), 2, 1)
    files = engine.state_files()
    held = files.distributed[""]["model"] if zero_stage == 3 else files.trees.get(MODULE_FILE, {})
    saved = sorted(held)
    engine.close()
    if dist.get_rank() != 0:
        return None
    return {
        "frozen": {str(d) for n, d in dtypes.items() if ".lora_" not in n},
        "adapters": {str(d) for n, d in dtypes.items() if ".lora_" in n},
        "losses": losses,
        "grad_norms": grad_norms,
        "saved": saved,
    }
