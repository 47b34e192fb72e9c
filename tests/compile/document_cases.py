"""What every rank runs in the packed-document tests: one SP step over packed rows against each
document trained alone on one device (the same rank), reduced to a few error figures."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sp_cases import VOCAB, step_against, tiny_model

from slurm_autosp.sp import IGNORE_INDEX


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


def packed_sp_step(case: PackedCase, sp_size: int, ring_size: int = 1) -> dict[str, float]:
    """One SP step (sp_size = ulysses x `ring_size`) over the packed rows against
    `documents_alone` (sp_cases.step_against)."""
    batch = packed_batch(case)
    reference = documents_alone(case, batch)
    model = tiny_model(case.family, case.kv_heads, window=case.window)
    return step_against(model, case.per_layer, batch, reference, sp_size, ring_size)
