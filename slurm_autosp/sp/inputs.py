"""Turn one full-sequence batch into this SP rank's shard, so SP training equals single-device.

Everything that depends on the whole sequence happens here, once, before sharding: labels
are shifted over the whole sequence (so the label pair crossing a shard boundary is kept),
padding becomes ignored labels (left padding also a document of its own, which no real token
attends to), and position ids are global. Packed rows (several documents
per row) get positions that restart per document, an ignored label at each document's end
and the cumulative document lengths of the whole batch, which every rank's attention reads
after its all-to-all. The compiled graph then sees only local tensors (and those lengths) and
is identical on every rank.

With ring attention (`ring_size` R > 1, an SP group of U x R ranks) the sequence is cut into
chunks and ring rank i = sp_rank // U holds some of them, so that causal attention costs every
ring rank the same (`ring_layout`: the zigzag, chunks i and 2R-1-i of 2R, or for packed rows a
deal of smaller chunks by their work); Ulysses member u = sp_rank % U holds the u-th contiguous
1/U of those chunks laid end to end, so the Ulysses all-to-all (gathering along the sequence in
group order) hands ring rank i exactly its chunks. Without a ring each rank holds one
contiguous 1/P of the sequence.
"""

from dataclasses import dataclass

import torch

from slurm_autosp.compat.torch_api import maybe_mark_dynamic
from slurm_autosp.sp.document_attention import document_spans
from slurm_autosp.sp.documents import (
    PackedRowsError,
    cumulative_lengths,
    first_valid_tokens,
    positions_within,
    starts_from_document_ids,
    starts_from_position_ids,
)
from slurm_autosp.sp.ring_layout import chunk_layout, chunks_per_row

IGNORE_INDEX = -100


@dataclass(frozen=True)
class SPBatch:
    """This rank's shard of a batch.

    `valid_labels` counts the labels of this shard that enter the loss. Summed over every
    rank of the world and every micro-batch of the optimizer step, it is the step's loss
    normaliser (`num_items_in_batch`). `real_tokens` [B, S/P] marks the shard's tokens that the
    model's own attention_mask would count, in the shard's order: not padding, not the SP
    padding added here (an MoE's router load-balancing loss counts exactly those; a real token
    whose label is ignored still counts). `cu_seqlens` (packed rows only) are the cumulative
    document lengths of the whole, padded batch, the same on every rank of the SP group, and
    `longest_document` the longest of those documents (0: not known). It is read once here, on
    the host: the CUDA kernel needs it, and reading it there would wait for the GPU in every
    layer.
    """

    input_ids: torch.Tensor
    shift_labels: torch.Tensor
    position_ids: torch.Tensor
    valid_labels: int
    real_tokens: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    longest_document: int = 0

    def model_kwargs(self, num_items_in_batch: torch.Tensor | int) -> dict[str, object]:
        """Keyword arguments for an HF causal LM: its loss is then this shard's summed token
        loss divided by `num_items_in_batch` (0 for a shard without valid labels).

        `labels` only switches HF's loss on; `shift_labels` is what it reads. The count goes in
        as a tensor so Dynamo does not specialise the graph on its value. `use_cache=False`:
        a KV cache would make every decoder layer a different graph. Packed rows' document
        lengths travel as HF's varlen attention arguments, which reach the attention function;
        their count changes from batch to batch, so it is symbolic from the first compile (the
        tensor itself reaches every layer: otherwise the second step would compile again). The
        longest document changes too: it travels as the length of an empty tensor
        ([longest, 0], HF's `max_length_q`/`max_length_k`), symbolic from the first compile as
        well, an int inside the graph that no device copy (FSDP2 moves inputs) turns into a read
        from the GPU. A plain int would compile the layers again at the second step.
        """
        kwargs: dict[str, object] = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "labels": self.shift_labels,
            "shift_labels": self.shift_labels,
            "num_items_in_batch": torch.as_tensor(num_items_in_batch, device=self.input_ids.device),
            "use_cache": False,
        }
        if self.cu_seqlens is not None:
            maybe_mark_dynamic(self.cu_seqlens, 0)
            kwargs["cu_seq_lens_q"] = kwargs["cu_seq_lens_k"] = self.cu_seqlens
        if self.cu_seqlens is not None and self.longest_document:
            longest = self.input_ids.new_empty(self.longest_document, 0)
            maybe_mark_dynamic(longest, 0)
            kwargs["max_length_q"] = kwargs["max_length_k"] = longest
        return kwargs


def _ignore_padding(labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Padded positions become ignored labels. Padding must be at the ends of a row (left, right
    or both): trailing padding comes after every token, so causal attention ignores it, and
    leading padding becomes a document of its own; a hole between tokens would need a mask."""
    valid = attention_mask.bool()
    index = torch.arange(valid.shape[1], device=valid.device).unsqueeze(0)
    first = torch.where(valid, index, valid.shape[1]).min(dim=1, keepdim=True).values
    run = (index >= first) & (index < first + valid.sum(dim=1, keepdim=True))
    if not torch.equal(valid, run):
        rows = (valid != run).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask of batch rows {rows} has padding between tokens (zeros after a one "
            "and before another). Sequence parallel attention is causal within documents without "
            "a mask, which is exact only for padding at the ends of a row: pad on the left or the "
            "right (packed rows pass position_ids or document_ids, not a mask)."
        )
    return labels.masked_fill(~valid, IGNORE_INDEX)


def _document_starts(
    position_ids: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(position ids, document starts or None when no row holds more than one document, left
    padding counting as one)."""
    batch, seq = valid.shape
    if document_ids is None and position_ids is None:
        position_ids = torch.arange(seq, device=valid.device).expand(batch, seq)
        starts = first_valid_tokens(valid)
        starts[:, 0] = True
    elif document_ids is None:
        assert position_ids is not None
        position_ids = position_ids.expand(batch, seq)
        starts = starts_from_position_ids(position_ids, valid)
    else:
        if document_ids.shape[-1] != seq:
            raise PackedRowsError(
                f"document_ids has shape {tuple(document_ids.shape)}; it needs one id per token of "
                f"input_ids {(batch, seq)}"
            )
        starts = starts_from_document_ids(document_ids.expand(batch, seq), valid)
        derived = positions_within(starts)
        if position_ids is not None and not torch.equal(
            position_ids.expand(batch, seq)[valid], derived[valid]
        ):
            raise PackedRowsError(
                "position_ids disagree with document_ids: each document's positions must run "
                "0, 1, 2, ...; pass document_ids alone and the positions are derived from them"
            )
        position_ids = derived
    return position_ids, starts if bool(starts[:, 1:].any()) else None


def sp_token_positions(
    seq: int,
    sp_rank: int,
    sp_size: int,
    ring_size: int = 1,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which positions of a row of `seq` tokens (padded as `prepare_sp_inputs` pads it) SP rank
    `sp_rank` holds, in its order: under a ring its ring rank's chunks (`ring_layout`: the
    zigzag, or for rows with the document boundaries `cu_seqlens` the work-balanced deal), of
    which it holds its Ulysses member's contiguous part; see the module docstring."""
    if ring_size == 1:
        shard = seq // sp_size
        return torch.arange(sp_rank * shard, (sp_rank + 1) * shard)
    ulysses = sp_size // ring_size
    ring_rank, member = divmod(sp_rank, ulysses)
    documents = None
    if cu_seqlens is not None:
        documents = tuple(document_spans(cu_seqlens, int(cu_seqlens[-1]) // seq, seq))
    held = chunk_layout(ring_size, seq, documents).positions(ring_rank)
    return held.view(ulysses, -1)[member]


def padded_length(seq: int, sp_size: int, ring_size: int = 1, packed: bool = False) -> int:
    """The length rows of `seq` tokens are padded to: a multiple of the SP size, under a ring of
    its chunks (`ring_layout`) times the Ulysses size, so every rank holds as many tokens."""
    multiple = sp_size
    if ring_size > 1:
        multiple = sp_size // ring_size * chunks_per_row(ring_size, packed)
    return seq + -seq % multiple


def _check_ring(sp_size: int, ring_size: int) -> None:
    if ring_size < 1 or sp_size % ring_size:
        raise ValueError(
            f"parallel.ring_size={ring_size} must divide parallel.sp_size={sp_size} "
            "(sp_size = ulysses x ring)"
        )


def prepare_sp_inputs(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    sp_rank: int,
    sp_size: int,
    pad_token_id: int = 0,
    document_ids: torch.Tensor | None = None,
    ring_size: int = 1,
) -> SPBatch:
    """Shard a [B, S] causal-LM batch for SP rank `sp_rank` of `sp_size`.

    `labels` default to `input_ids` (they are shifted here, as HF would shift them).
    `attention_mask` may only mark padding at the ends of rows ([B, S]; custom masks and holes are
    refused); left padding is then a document that no real token attends to, with default
    positions counted from the row's start as Hugging Face counts them. S need not divide by `sp_size`: the batch is
    padded with `pad_token_id` tokens whose labels are ignored. A row holds several documents
    when its `position_ids` restart at 0 or its `document_ids` [B, S] change; attention then
    stays within each document, and no label predicts across a boundary. With `ring_size` > 1
    the SP group is ulysses x ring ranks and the shard is this rank's share of its ring rank's
    chunks (module docstring; the batch is padded to `padded_length`), the documents'
    boundaries global as without a ring.
    """
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} is outside the SP group of size {sp_size}")
    batch, seq = input_ids.shape
    labels = input_ids if labels is None else labels
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, not the [batch, seq] padding mask "
            f"{tuple(input_ids.shape)} of input_ids: custom attention masks (4-D, per token pair) are not "
            "supported under sequence parallelism; pass a padding mask (left or right padding) or none"
        )
    if attention_mask is not None:
        labels = _ignore_padding(labels, attention_mask)
    valid = (
        torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask is None
        else attention_mask.bool()
    )
    position_ids, starts = _document_starts(position_ids, document_ids, valid)

    ignored_last = torch.full_like(labels[:, :1], IGNORE_INDEX)
    shift_labels = torch.cat([labels[:, 1:], ignored_last], dim=1)
    if starts is not None:  # a document's last token predicts nothing: the next token is another's
        shift_labels[:, :-1].masked_fill_(starts[:, 1:], IGNORE_INDEX)
    _check_ring(sp_size, ring_size)
    padding = padded_length(seq, sp_size, ring_size, starts is not None) - seq
    position_tail = position_ids[:, -1:] + torch.arange(1, padding + 1, device=position_ids.device)
    position_ids = torch.cat([position_ids, position_tail], dim=1)
    input_ids = torch.nn.functional.pad(input_ids, (0, padding), value=pad_token_id)
    shift_labels = torch.nn.functional.pad(shift_labels, (0, padding), value=IGNORE_INDEX)
    real_tokens = torch.nn.functional.pad(valid, (0, padding), value=False)

    cu_seqlens = None if starts is None else cumulative_lengths(starts, input_ids.shape[1])
    if ring_size == 1:
        shard = input_ids.shape[1] // sp_size
        local: slice | torch.Tensor = slice(sp_rank * shard, (sp_rank + 1) * shard)
    else:
        positions = sp_token_positions(input_ids.shape[1], sp_rank, sp_size, ring_size, cu_seqlens)
        local = positions.to(input_ids.device)
    local_labels = shift_labels[:, local].contiguous()
    return SPBatch(
        input_ids=input_ids[:, local].contiguous(),
        shift_labels=local_labels,
        position_ids=position_ids[:, local].contiguous(),
        valid_labels=int((local_labels != IGNORE_INDEX).sum()),
        real_tokens=real_tokens[:, local].contiguous(),
        cu_seqlens=cu_seqlens,
        longest_document=0 if cu_seqlens is None else int(cu_seqlens.diff().max()),
    )
