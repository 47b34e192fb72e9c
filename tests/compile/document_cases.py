"""What every rank runs in the packed-document tests: one SP step over packed rows against each
document trained alone on one device (the same rank), reduced to a few error figures."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sp_cases import VOCAB, backend_for, contiguous_sp_group, tiny_model

from slurm_autosp.compile import (
    IGNORE_INDEX,
    compile_model,
    loss_scale,
    prepare_sp_inputs,
    set_sp_group,
)


@dataclass(frozen=True)
class PackedCase:
    """Rows of documents of the given lengths; `batch` rows are split over data parallelism."""

    lengths: tuple[tuple[int, ...], ...]
    convention: str = "position_ids"  # position_ids (restarting, as HF packs) | document_ids
    family: str = "llama"
    kv_heads: int = 2
    per_layer: bool = False
    ignored_labels: bool = False  # some labels inside documents ignored too
    window: int | None = None  # mistral's sliding_window, within each document


def packed_batch(case: PackedCase) -> dict[str, torch.Tensor]:
    """The whole global batch, identical on every rank, in the case's convention."""
    seq = sum(case.lengths[0])
    assert all(sum(row) == seq for row in case.lengths), "rows of one batch have one length"
    generator = torch.Generator().manual_seed(seq)
    input_ids = torch.randint(1, VOCAB, (len(case.lengths), seq), generator=generator)
    labels = input_ids.clone()
    if case.ignored_labels:
        labels[torch.rand(labels.shape, generator=generator) < 0.3] = IGNORE_INDEX
    document_ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in case.lengths]
    )
    positions = torch.cat([torch.arange(n) for row in case.lengths for n in row]).view(-1, seq)
    batch = {"input_ids": input_ids, "labels": labels}
    if case.convention == "document_ids":
        batch["document_ids"] = document_ids
    else:
        batch["position_ids"] = positions
    return batch


def documents_alone(
    case: PackedCase, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The reference: the plain HF model on each document alone; the loss is the sum of every
    document's token losses over the global label count. Returns it, the per-token losses laid
    out as the packed rows [B, S], and the gradients."""
    model = tiny_model(case.family, case.kv_heads, window=case.window)
    pieces = []
    for row, lengths in enumerate(case.lengths):
        start = 0
        for length in lengths:
            pieces.append((row, start, start + length))
            start += length
    count = sum(int((batch["labels"][r, s + 1 : e] != IGNORE_INDEX).sum()) for r, s, e in pieces)
    total = torch.zeros(())
    per_token = torch.zeros(batch["input_ids"].shape)
    for row, start, end in pieces:
        ids, labels = (
            batch["input_ids"][row : row + 1, start:end],
            batch["labels"][row : row + 1, start:end],
        )
        out = model(
            input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(count), use_cache=False
        )
        total = total + out.loss
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        per_token[row, start:end] = F.cross_entropy(
            out.logits.detach()[0], shifted[0], reduction="none"
        )
    total.backward()
    return total.detach(), per_token, {n: p.grad for n, p in model.named_parameters()}


def packed_sp_step(case: PackedCase, sp_size: int) -> dict[str, float]:
    """One SP step over the packed rows, gradients averaged over the world as ZeRO-1 does,
    against `documents_alone`: relative loss error, max per-token error on this rank's shard,
    and the worst parameter's max|g - g_ref| / max|g_ref|."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sp_group = contiguous_sp_group(sp_size)
    sp_rank, dp_rank, dp_size = rank % sp_size, rank // sp_size, world // sp_size
    batch = packed_batch(case)
    ref_loss, ref_per_token, ref_grads = documents_alone(case, batch)

    rows = len(case.lengths)
    mine = slice(dp_rank * rows // dp_size, (dp_rank + 1) * rows // dp_size)
    shard = prepare_sp_inputs(
        **{k: v[mine] for k, v in batch.items()}, sp_rank=sp_rank, sp_size=sp_size
    )
    assert shard.cu_seqlens is not None, "packed rows must reach document attention"
    count = torch.tensor(shard.valid_labels)
    dist.all_reduce(count)

    model = tiny_model(case.family, case.kv_heads, window=case.window)
    backend = backend_for(sp_size, case.per_layer)
    compile_model(model, backend, per_layer=case.per_layer)
    kwargs = shard.model_kwargs(count)
    for name in ("input_ids", "position_ids", "shift_labels"):
        torch._dynamo.mark_dynamic(kwargs[name], 1)
    set_sp_group(sp_group)
    out = model(**kwargs)
    (out.loss * loss_scale(world, grad_accum=1)).backward()
    backend.require_sdpa_found()

    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    per_token = F.cross_entropy(
        out.logits.detach().transpose(1, 2), shard.shift_labels, reduction="none"
    )
    shard_len = shard.input_ids.shape[1]
    padded_ref = F.pad(ref_per_token, (0, shard_len * sp_size - ref_per_token.shape[1]))
    ref_local = padded_ref[mine, sp_rank * shard_len : (sp_rank + 1) * shard_len]
    grad_error = 0.0
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)
        param.grad /= world
        reference = ref_grads[name]
        grad_error = max(
            grad_error, float((param.grad - reference).abs().max() / reference.abs().max())
        )
    return {
        "loss_rel_error": float((loss - ref_loss).abs() / ref_loss.abs()),
        "token_error": float((per_token - ref_local).abs().max()),
        "grad_rel_error": grad_error,
        "finite": bool(torch.isfinite(out.loss)),
    }
