"""What every verify rank runs: the AutoSP step and, on rank 0, the single-device reference."""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slurm_autosp.cluster.parallel_dims import ParallelDims, contiguous_parallel_dims
from slurm_autosp.compile import AutoSPBackend, compile_model
from slurm_autosp.config import CompileConfig, JobConfig, ModelConfig
from slurm_autosp.lora import randomize_adapters
from slurm_autosp.model import build_model
from slurm_autosp.run_step import run_module_step
from slurm_autosp.sp import IGNORE_INDEX, set_sp_groups, sp_token_positions
from slurm_autosp.sp.inputs import padded_length
from slurm_autosp.sp.step import shard_for_rank
from slurm_autosp.verify.options import (
    Inject,
    VerifyOptions,
    shrink_model_config,
    verify_seq_len,
)
from slurm_autosp.verify.packed_rows import DocumentLayout, verify_layout
from slurm_autosp.verify.report import Report

GRADIENT_SCALE_FLOOR = 1e-5


@contextmanager
def full_fp32() -> Iterator[None]:
    """No TF32 or reduced-precision matmuls inside: the comparison is against exact fp32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        torch.set_float32_matmul_precision(precision)


def make_batch(rows: int, seq_len: int, vocab_size: int, seed: int) -> dict[str, Any]:
    """Random tokens, with ignored labels thinning out along the sequence (90% ignored at the
    start, none at the end), so SP shards hold very different numbers of valid labels."""

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (rows, seq_len), generator=generator)
    labels = input_ids.clone()
    ignored = torch.rand(rows, seq_len, generator=generator) < torch.linspace(0.9, 0.0, seq_len)
    labels[ignored] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


def shift_labels_per_shard(labels: Any, sp_rank: int, sp_size: int) -> Any:
    """THE BUG verify must catch: shard the labels first, then shift inside the shard. The last
    token of every shard loses its target (the first token of the next shard)."""

    padded = F.pad(labels, (0, -labels.shape[1] % sp_size), value=IGNORE_INDEX)
    shard = padded.shape[1] // sp_size
    local = padded[:, sp_rank * shard : (sp_rank + 1) * shard]
    return torch.cat(
        [local[:, 1:], torch.full_like(local[:, :1], IGNORE_INDEX)], dim=1
    ).contiguous()


def _per_token_loss(logits: Any, shift_labels: Any) -> Any:
    return F.cross_entropy(logits.detach().float().transpose(1, 2), shift_labels, reduction="none")


def _sequences(batch: dict[str, Any], layout: DocumentLayout | None) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sequence the reference trains alone: each document of a
    packed row, else each whole row."""
    rows, seq = batch["input_ids"].shape
    spans = (
        [(0, seq)]
        if layout is None
        else [(s, s + n) for s, n in zip(layout.starts, layout.lengths, strict=True)]
    )
    return [(row, start, end) for row in range(rows) for start, end in spans]


def _reference(
    model: Any, batch: dict[str, Any], layout: DocumentLayout | None, replicas: int
) -> tuple[float, Any, dict[str, Any]]:
    """The unmodified model on one device, each sequence (document) alone, none of AutoSP's
    code involved: the loss is every token loss over the batch's label count. Returns it, the
    per-token losses [B, S] and the gradients.

    An MoE's router load-balancing loss is over a whole micro-batch, not a sum over sequences:
    the model's own aux of each sequence is taken out, and coef x its family's
    `load_balancing_loss_func` over each DP replica's rows as one micro-batch (their router
    logits laid end to end: a token's router logits do not depend on the other sequences) is
    put in, averaged over the replicas."""

    sequences = _sequences(batch, layout)
    labels = batch["labels"]
    count = sum(int((labels[r, s + 1 : e] != IGNORE_INDEX).sum()) for r, s, e in sequences)
    loss = torch.zeros((), device=labels.device)
    per_token = torch.zeros(labels.shape, device=labels.device)
    routers: list[list[Any]] = [[] for _ in range(replicas)]
    rows_per_replica = labels.shape[0] // replicas
    for row, start, end in sequences:
        piece = labels[row : row + 1, start:end]
        out = model(
            input_ids=batch["input_ids"][row : row + 1, start:end],
            labels=piece,
            num_items_in_batch=torch.tensor(max(count, 1), device=labels.device),
            use_cache=False,
        )
        loss = loss + out.loss
        if getattr(out, "aux_loss", None) is not None:
            loss = loss - model.router_aux_loss_coef * out.aux_loss
            routers[row // rows_per_replica].append(out.router_logits)
        shifted = F.pad(piece[:, 1:], (0, 1), value=IGNORE_INDEX)
        per_token[row, start:end] = _per_token_loss(out.logits, shifted)[0]
    if any(routers):
        family = sys.modules[type(model).__module__].load_balancing_loss_func
        for pieces in routers:
            logits = tuple(torch.cat(layer) for layer in zip(*pieces, strict=True))
            aux = family(logits, model.num_experts, model.num_experts_per_tok, None)
            loss = loss + model.router_aux_loss_coef * aux / replicas
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), per_token, grads


def run_rank(
    rank: int,
    world_size: int,
    cfg: JobConfig,
    options: VerifyOptions,
    init_file: str,
    result_file: str,
) -> None:
    """One spawned CPU rank of `python -m slurm_autosp verify`: joins a gloo group, lays the
    ranks out as a job would (contiguous SP groups, their Ulysses and ring groups) and runs
    `compare_sp_step`; rank 0 writes the report."""

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        dims = contiguous_parallel_dims(
            cfg.parallel.sp_size, cfg.parallel.ring_size or 1, torch.device("cpu")
        )
        with full_fp32():
            report = compare_sp_step(cfg, options, dims)
        if report is not None:
            torch.save(dataclasses.asdict(report), result_file)
    finally:
        dist.destroy_process_group()


def compare_sp_step(
    cfg: JobConfig,
    options: VerifyOptions,
    dims: ParallelDims,
    dtype: torch.dtype = torch.float32,
) -> Report | None:
    """One AutoSP step of the shrunk model on this rank's shard, over `dims`' Ulysses and ring
    groups and on its device, gradients averaged over the world; rank 0 also runs the
    unmodified model on one device (fp32) and returns the report, every other rank None.

    Every rank of the world calls it: verify's spawned ranks, and a job's own ranks before
    training (its start check). `dtype` is the AutoSP step's: bf16 where a device's kernels
    compute nothing else (the reference stays fp32)."""

    sp_size, ring_size, world_size = dims.sp_size, dims.ring_size, dims.world_size
    model_cfg = shrink_model_config(cfg.model, options)
    seq_len = verify_seq_len(sp_size, options)
    assert model_cfg.vocab_size is not None  # shrink_model_config sets it
    batch = make_batch(options.rows * dims.dp_size, seq_len, model_cfg.vocab_size, options.seed)
    layout = verify_layout(sp_size, options)
    if layout is not None:
        batch["document_ids"] = layout.document_ids().repeat(options.rows * dims.dp_size, 1)
    batch = {key: value.to(dims.device) for key, value in batch.items()}

    torch.manual_seed(options.seed)
    model = build_model(model_cfg).float()
    randomize_adapters(model, options.seed)
    reference_model = copy.deepcopy(model).to(dims.device) if dims.rank == 0 else None
    model.to(device=dims.device, dtype=dtype)

    rows = slice(dims.dp_rank * options.rows, (dims.dp_rank + 1) * options.rows)
    local = {key: value[rows] for key, value in batch.items()}
    shard = shard_for_rank(dims, **local)
    if options.inject is Inject.per_shard_shift:
        buggy = shift_labels_per_shard(local["labels"], dims.sp_rank, sp_size)
        shard = dataclasses.replace(
            shard, shift_labels=buggy, valid_labels=int((buggy != -100).sum())
        )

    backend = AutoSPBackend(sp_size, ring_size=ring_size, codegen=options.codegen)
    compile_model(model, backend, per_layer=cfg.compile.per_layer)
    set_sp_groups(dims.ulysses_group, dims.ring_group)
    # unchunked, logits kept: they give the per-token losses
    step = run_module_step(model, [shard], sp_size, dims.dp_size, keep_logits=True)
    (micro,), count = step.micro_batches, step.num_items
    sp_loss, logits = micro.loss, micro.logits
    assert logits is not None
    backend.require_sdpa_found()

    loss = sp_loss.detach().float()
    dist.all_reduce(loss)
    per_token = _per_token_loss(logits, shard.shift_labels).contiguous()
    gathered = [torch.empty_like(per_token) for _ in range(world_size)]
    dist.all_gather(gathered, per_token)
    grads = {}
    for name, param in model.named_parameters():
        grad = (param.grad if param.grad is not None else torch.zeros_like(param)).float()
        dist.all_reduce(grad)
        grads[name] = grad / world_size
    if dims.rank != 0:
        return None

    assert reference_model is not None
    low = None
    if dtype != torch.float32:  # what the dtype alone costs: the unmodified model in it
        low = _reference(copy.deepcopy(reference_model).to(dtype), batch, layout, dims.dp_size)
    ref_loss, ref_per_token, ref_grads = _reference(reference_model, batch, layout, dims.dp_size)
    # never below a share of the model's largest gradient: one that is zero in exact arithmetic
    # (a key projection's bias: softmax ignores it) is rounding alone
    largest = max((float(g.abs().max()) for g in ref_grads.values()), default=0.0)
    floor = GRADIENT_SCALE_FLOOR * largest
    baseline = None
    if low is not None:
        low_loss, low_per_token, low_grads = low
        baseline = max(
            abs(low_loss - ref_loss) / max(abs(ref_loss), 1e-30),
            float((low_per_token - ref_per_token).abs().max()),
            *(_relative(low_grads[name], grad, floor) for name, grad in ref_grads.items()),
        )
    # gathered[rank] is (dp_rank, sp_rank)'s [rows, shard]: rows by DP, sequence by SP
    # (sp_rank's positions: a contiguous slice, its ring rank's chunks' share under a ring)
    padded = per_token.shape[1] * sp_size
    full = per_token.new_empty(options.rows * dims.dp_size, padded)
    for r, tokens in enumerate(gathered):
        d, s = dims.layout.dp_rank(r), dims.layout.sp_rank(r)
        positions = sp_token_positions(padded, s, sp_size, ring_size, shard.cu_seqlens)
        positions = positions.to(dims.device)
        full[d * options.rows : (d + 1) * options.rows, positions] = tokens
    token_diff = (full[:, :seq_len] - ref_per_token).abs()
    mismatched = sorted({int(p) for p in (token_diff > options.tolerance).nonzero()[:, 1].tolist()})
    grad_errors = {
        _short_name(name): _relative(grads[name], reference, floor)
        for name, reference in ref_grads.items()
    }
    return Report(
        description=_describe(
            cfg.compile, dims, dtype, model_cfg, options, seq_len, int(count), batch, layout
        ),
        sp_size=sp_size,
        seq_len=seq_len,
        shard_len=shard.input_ids.shape[1],
        loss=float(loss),
        ref_loss=ref_loss,
        token_error=float(token_diff.max()),
        mismatched_positions=mismatched,
        grad_errors=grad_errors,
        baseline_error=baseline,
    )


def _relative(grad: torch.Tensor, reference: torch.Tensor, floor: float) -> float:
    """max |g - g_ref| / max(max |g_ref|, floor)."""
    scale = reference.abs().max().clamp(min=max(floor, 1e-30))
    return float((grad.float() - reference).abs().max() / scale)


def _short_name(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def _describe(
    compile: CompileConfig,
    dims: ParallelDims,
    dtype: torch.dtype,
    model: ModelConfig,
    options: VerifyOptions,
    seq_len: int,
    count: int,
    batch: dict[str, Any],
    layout: DocumentLayout | None,
) -> str:
    sp, ring_size = dims.sp_size, dims.ring_size
    injected = (
        f"; INJECTED BUG: {options.inject.value}" if options.inject is not Inject.none else ""
    )
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    assert heads is not None and kv is not None  # shrink_model_config sets both
    ring = f" (Ulysses {sp // ring_size} x ring {ring_size})" if ring_size > 1 else ""
    padded = padded_length(seq_len, sp, ring_size, packed=layout is not None)
    codegen = "" if options.codegen else ", no inductor (verify.codegen=false)"
    lora = model.lora
    adapters = (
        f"; LoRA rank {lora.rank} on {', '.join(lora.target_modules)} (adapters random)"
        if lora
        else ""
    )
    return (
        f"AutoSP verify: {model.model_type}, {heads} query heads / {kv} KV heads (GQA {heads // kv}:1), shrunk to "
        f"{model.num_hidden_layers} layers, head_dim {model.head_dim}, hidden {model.hidden_size}, "
        f"vocab {model.vocab_size}{adapters}\n"
        f"  sp_size={sp}{ring} x dp={dims.dp_size} {dims.device.type} ranks, {str(dtype).removeprefix('torch.')} "
        f"(reference fp32), "
        f"compile.per_layer={compile.per_layer}{codegen}; batch {batch['input_ids'].shape[0]} x {seq_len} tokens "
        f"(padded to {padded} = {sp} shards of {padded // sp}), {count} valid labels{injected}"
        + ("" if layout is None else f"\n  packed: {layout.describe()}")
    )
