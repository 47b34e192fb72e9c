"""What every verify rank runs: the AutoSP step and, on rank 0, the single-device reference."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slurm_autosp.cluster.layout import ParallelLayout, build_process_groups
from slurm_autosp.compile import AutoSPBackend, compile_model
from slurm_autosp.config import JobConfig, ModelConfig
from slurm_autosp.model import build_model
from slurm_autosp.sp import (
    IGNORE_INDEX,
    loss_scale,
    prepare_sp_inputs,
    set_sp_groups,
    sp_token_positions,
)
from slurm_autosp.verify.options import (
    Inject,
    VerifyOptions,
    shrink_model_config,
    verify_seq_len,
)
from slurm_autosp.verify.packed_rows import DocumentLayout, verify_layout
from slurm_autosp.verify.report import Report

GRADIENT_SCALE_FLOOR = 1e-5


def force_full_fp32() -> None:
    """No TF32 or reduced-precision matmuls: the comparison is against exact fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


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
    model: Any, batch: dict[str, Any], layout: DocumentLayout | None
) -> tuple[float, Any, dict[str, Any]]:
    """The unmodified model on one device, each sequence (document) alone, none of AutoSP's
    code involved: the loss is every token loss over the batch's label count. Returns it, the
    per-token losses [B, S] and the gradients."""

    sequences = _sequences(batch, layout)
    labels = batch["labels"]
    count = sum(int((labels[r, s + 1 : e] != IGNORE_INDEX).sum()) for r, s, e in sequences)
    loss = torch.zeros(())
    per_token = torch.zeros(labels.shape)
    for row, start, end in sequences:
        piece = labels[row : row + 1, start:end]
        out = model(
            input_ids=batch["input_ids"][row : row + 1, start:end],
            labels=piece,
            num_items_in_batch=torch.tensor(max(count, 1)),
            use_cache=False,
        )
        loss = loss + out.loss
        shifted = F.pad(piece[:, 1:], (0, 1), value=IGNORE_INDEX)
        per_token[row, start:end] = _per_token_loss(out.logits, shifted)[0]
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
    """One spawned rank: joins the gloo world, runs `verify_step`, and rank 0 writes the report."""

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        report = verify_step(cfg, options)
        if report is not None:
            torch.save(dataclasses.asdict(report), result_file)
    finally:
        dist.destroy_process_group()


def verify_step(cfg: JobConfig, options: VerifyOptions) -> Report | None:
    """One rank of an existing gloo world of sp_size x dp ranks: an AutoSP step on its shard,
    gradients averaged over the world; rank 0 also runs the reference and returns the report
    (None elsewhere). Apart from `run_rank` so a pool of ranks kept for many checks (the
    family battery) runs it without starting processes."""

    force_full_fp32()
    world_size, rank = dist.get_world_size(), dist.get_rank()
    sp_size, ring_size = cfg.parallel.sp_size, cfg.parallel.ring_size or 1
    sp_rank, dp_rank = rank % sp_size, rank // sp_size
    # contiguous SP groups, their Ulysses and ring groups as a job's layout places them
    parallel = ParallelLayout.from_sp_groups(
        tuple(tuple(range(s, s + sp_size)) for s in range(0, world_size, sp_size)),
        ring_size=ring_size,
    )
    groups = build_process_groups(parallel)
    model_cfg = shrink_model_config(cfg.model, options)
    seq_len = verify_seq_len(sp_size, options)
    assert model_cfg.vocab_size is not None  # shrink_model_config sets it
    batch = make_batch(options.rows * options.dp, seq_len, model_cfg.vocab_size, options.seed)
    layout = verify_layout(sp_size, options)
    if layout is not None:
        batch["document_ids"] = layout.document_ids().repeat(options.rows * options.dp, 1)

    torch.manual_seed(options.seed)
    model = build_model(model_cfg).float()
    reference_model = copy.deepcopy(model) if rank == 0 else None

    rows = slice(dp_rank * options.rows, (dp_rank + 1) * options.rows)
    local = {key: value[rows] for key, value in batch.items()}
    shard = prepare_sp_inputs(**local, sp_rank=sp_rank, sp_size=sp_size, ring_size=ring_size)
    if options.inject is Inject.per_shard_shift:
        buggy = shift_labels_per_shard(local["labels"], sp_rank, sp_size)
        shard = dataclasses.replace(
            shard, shift_labels=buggy, valid_labels=int((buggy != -100).sum())
        )
    count = torch.tensor(shard.valid_labels)
    dist.all_reduce(count)

    backend = AutoSPBackend(sp_size, ring_size=ring_size, codegen=options.codegen)
    compile_model(model, backend, per_layer=cfg.compile.per_layer)
    set_sp_groups(groups.ulysses, groups.ring)
    out = model(**shard.model_kwargs(count.clamp(min=1)))
    (out.loss * loss_scale(world_size, grad_accum=1)).backward()
    backend.require_sdpa_found()

    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    per_token = _per_token_loss(out.logits, shard.shift_labels).contiguous()
    gathered = [torch.empty_like(per_token) for _ in range(world_size)]
    dist.all_gather(gathered, per_token)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        grads[name] = grad / world_size
    if rank != 0:
        return None

    ref_loss, ref_per_token, ref_grads = _reference(reference_model, batch, layout)
    # gathered[rank] is (dp_rank, sp_rank)'s [rows, shard]: rows by DP, sequence by SP
    # (sp_rank's positions: a contiguous slice, its zigzag share under a ring)
    padded = per_token.shape[1] * sp_size
    full = per_token.new_empty(options.rows * options.dp, padded)
    for r, tokens in enumerate(gathered):
        d, s = divmod(r, sp_size)
        positions = sp_token_positions(padded, s, sp_size, ring_size)
        full[d * options.rows : (d + 1) * options.rows, positions] = tokens
    token_diff = (full[:, :seq_len] - ref_per_token).abs()
    mismatched = sorted({int(p) for p in (token_diff > options.tolerance).nonzero()[:, 1].tolist()})
    grad_errors = {}
    largest = max(float(r.abs().max()) for r in ref_grads.values()) if ref_grads else 0.0
    for name, reference in ref_grads.items():
        # never below a 1e-5 share of the model's largest: a gradient that is zero in exact
        # arithmetic (a key projection's bias: softmax ignores it) is rounding alone
        scale = reference.abs().max().clamp(min=max(GRADIENT_SCALE_FLOOR * largest, 1e-30))
        grad_errors[_short_name(name)] = float((grads[name] - reference).abs().max() / scale)
    return Report(
        description=_describe(
            cfg, model_cfg, options, seq_len, count=int(count), batch=batch, layout=layout
        ),
        sp_size=sp_size,
        seq_len=seq_len,
        shard_len=shard.input_ids.shape[1],
        loss=float(loss),
        ref_loss=ref_loss,
        token_error=float(token_diff.max()),
        mismatched_positions=mismatched,
        grad_errors=grad_errors,
    )


def _short_name(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def _describe(
    cfg: JobConfig,
    model: ModelConfig,
    options: VerifyOptions,
    seq_len: int,
    count: int,
    batch: dict[str, Any],
    layout: DocumentLayout | None,
) -> str:
    sp = cfg.parallel.sp_size
    injected = (
        f"; INJECTED BUG: {options.inject.value}" if options.inject is not Inject.none else ""
    )
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    assert heads is not None and kv is not None  # shrink_model_config sets both
    ring_size = cfg.parallel.ring_size or 1
    ring = f" (Ulysses {sp // ring_size} x ring {ring_size})" if ring_size > 1 else ""
    padded = seq_len + (-seq_len % (sp if ring_size == 1 else 2 * sp))
    codegen = "" if options.codegen else ", no inductor (verify.codegen=false)"
    return (
        f"AutoSP verify: {model.model_type}, {heads} query heads / {kv} KV heads (GQA {heads // kv}:1), shrunk to "
        f"{model.num_hidden_layers} layers, head_dim {model.head_dim}, hidden {model.hidden_size}, "
        f"vocab {model.vocab_size}\n"
        f"  sp_size={sp}{ring} x dp={options.dp} local CPU ranks (gloo), fp32, "
        f"compile.per_layer={cfg.compile.per_layer}{codegen}; batch {batch['input_ids'].shape[0]} x {seq_len} tokens "
        f"(padded to {padded} = {sp} shards of {padded // sp}), {count} valid labels{injected}"
        + ("" if layout is None else f"\n  packed: {layout.describe()}")
    )
