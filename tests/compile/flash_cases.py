"""The CUDA paths of document attention and ring attention run on CPU through the model of
flash's contract (tests/flash_contract.py), against exact masked attention in float64.

A case is a batch as users give it (document lengths per row, left padding, a window) under an
SP layout (Ulysses x ring, heads as each rank holds them). Its boundaries come from
`prepare_sp_inputs`, and its ring from `ring_plan` and `chunk_layout`, as ring attention derives
them on every rank; each rank's rounds run through `varlen_kernel.flash_forward` and
`flash_backward` (the arguments CUDA gets) against each source's block, merged by their
log-sum-exps as ring attention merges them. The reference attends each query to the keys of
its document, no later than itself and within the window."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from flash_contract import FlashContract

from slurm_autosp.sp import prepare_sp_inputs
from slurm_autosp.sp.document_attention import (
    document_spans,
    flash_forward,
    varlen_backward,
)
from slurm_autosp.sp.inputs import padded_length
from slurm_autosp.sp.ring_layout import chunk_layout
from slurm_autosp.sp.ring_plan import Index, RingPlan, ring_plan
from slurm_autosp.sp.varlen_kernel import flash_backward as ring_flash_backward
from slurm_autosp.sp.varlen_kernel import flash_forward as ring_flash_forward

HEAD_DIM = 8
SCALE = HEAD_DIM**-0.5


@dataclass(frozen=True)
class AttentionCase:
    """Rows of `lengths` documents (None: each row one, no boundaries), each row's first
    `left_padding` tokens padding; a `window` of keys (0: none); SP of `ulysses` x `ring` ranks
    over `heads` (query, KV) heads."""

    lengths: tuple[tuple[int, ...], ...] | None
    seq: int
    window: int = 0
    left_padding: tuple[int, ...] = ()
    ulysses: int = 1
    ring: int = 1
    heads: tuple[int, int] = (4, 2)

    @property
    def rank_heads(self) -> tuple[int, int]:
        """The (query, KV) heads one rank's kernel sees after the Ulysses all-to-all: KV heads
        split too, or each rank one of them when there are fewer than ranks."""
        query, kv = self.heads
        return query // self.ulysses, max(1, kv // self.ulysses)

    @property
    def batch(self) -> int:
        return len(self.lengths) if self.lengths is not None else max(1, len(self.left_padding))


def draw_case(rng: random.Random) -> AttentionCase:
    """A case of the property test: lengths divisible by nothing in particular, documents of
    one token up to whole rows, windows of one key up to past the row, left padding."""
    ring = rng.choice((2, 4, 8))
    ulysses = rng.choice((1, 2, 4))
    query_heads = ulysses * rng.choice((1, 2, 4))
    kv_heads = rng.choice([h for h in (1, 2, 4, 8) if query_heads % h == 0 and h <= query_heads])
    if kv_heads > ulysses and kv_heads % ulysses:
        kv_heads = ulysses
    batch = rng.choice((1, 2))
    long_chunks = ring < 8 and rng.random() < 0.3  # chunks long enough to slice under a window
    seq = rng.randrange(2 * ring + 1, (160 if long_chunks else 24) * ring)
    lengths = None
    if rng.random() < 0.8:
        lengths = tuple(_partition(rng, seq) for _ in range(batch))
    window = 0 if rng.random() < 0.25 else rng.choice((1, 2, 3, rng.randrange(1, seq + 8)))
    left_padding = ()
    if rng.random() < 0.3:
        left_padding = tuple(rng.randrange(0, max(1, seq // 3)) for _ in range(batch))
    return AttentionCase(lengths, seq, window, left_padding, ulysses, ring, (query_heads, kv_heads))


def _partition(rng: random.Random, total: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, total), rng.randrange(0, min(6, total - 1) + 1)))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True))


@dataclass(frozen=True)
class Batch:
    """A case's batch as the SP runtime sees it: the padded row length and the boundaries."""

    seq: int
    cu_seqlens: torch.Tensor | None
    longest: int

    def documents(self, batch: int) -> tuple[tuple[int, int, int], ...]:
        return tuple(document_spans(self.cu_seqlens, batch, self.seq))


def sp_batch(case: AttentionCase) -> Batch:
    """The boundaries `prepare_sp_inputs` gives the case's rows under its SP layout."""
    input_ids = torch.zeros(case.batch, case.seq, dtype=torch.long)
    document_ids = None
    if case.lengths is not None:
        document_ids = torch.stack(
            [
                torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
                for row in case.lengths
            ]
        )
    mask = None
    if case.left_padding:
        mask = torch.ones(case.batch, case.seq, dtype=torch.long)
        for row, pad in enumerate(case.left_padding):
            mask[row, :pad] = 0
    shard = prepare_sp_inputs(
        input_ids,
        attention_mask=mask,
        document_ids=document_ids,
        sp_rank=0,
        sp_size=case.ulysses * case.ring,
        ring_size=case.ring,
    )
    packed = shard.cu_seqlens is not None
    seq = padded_length(case.seq, case.ulysses * case.ring, case.ring, packed)
    return Batch(seq, shard.cu_seqlens, shard.longest_document)


def _allowed(documents: tuple[tuple[int, int, int], ...], batch: int, seq: int, window: int):
    """[B, S, S]: query i of a row attends key j of its document, j <= i, i - j < window."""
    document = torch.full((batch, seq), -1)
    for index, (row, start, end) in enumerate(documents):
        document[row, start:end] = index
    i = torch.arange(seq).unsqueeze(1)
    j = torch.arange(seq).unsqueeze(0)
    keep = (document.unsqueeze(2) == document.unsqueeze(1)) & (j <= i)
    if window:
        keep &= i - j < window
    return keep


@dataclass
class Tensors:
    """Query, key, value and output gradient [B, S, H, D] in float64; the reference's output,
    log-sum-exp [B, S, H] and gradients."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    grad_output: torch.Tensor
    output: torch.Tensor
    lse: torch.Tensor
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def reference(case: AttentionCase, batch: Batch, seed: int) -> Tensors:
    """Exact masked attention of random inputs, forward and backward, in float64."""
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads = case.rank_heads
    shape = (case.batch, batch.seq)
    query, key, value, grad_output = (
        torch.randn(*shape, h, HEAD_DIM, generator=generator, dtype=torch.float64)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    group = heads // kv_heads
    q, k, v = (t.transpose(1, 2) for t in leaves)
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    allowed = _allowed(batch.documents(case.batch), case.batch, batch.seq, case.window)
    scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    output = (scores.softmax(dim=-1) @ v).transpose(1, 2)
    grads = torch.autograd.grad(output, leaves, grad_output)
    return Tensors(
        query,
        key,
        value,
        grad_output,
        output.detach(),
        lse.detach().transpose(1, 2),
        tuple(g.detach() for g in grads),
    )


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude, or 1 where that is
    smaller (a gradient that is exactly 0, as of one-token documents); NaN counts as inf."""
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp(min=1.0))


def document_errors(
    case: AttentionCase, seed: int = 0, head_major: bool = False
) -> dict[str, float]:
    """Document attention's CUDA path (one flash varlen call over the batch) through the
    contract, after the Ulysses all-to-all: each rank holds the whole rows for its heads, laid
    out token by token as HF's projections give them, or `head_major` as the all-to-all does."""
    batch = sp_batch(case)
    want = reference(case, batch, seed)
    tensors = (want.query, want.key, want.value, want.grad_output)
    q, k, v, g = (t.transpose(1, 2) for t in tensors)
    if head_major:
        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    with FlashContract():
        output, lse = flash_forward(q, k, v, batch.cu_seqlens, SCALE, case.window, batch.longest)
        grads = varlen_backward(
            g, q, k, v, output, lse, batch.cu_seqlens, SCALE, case.window, batch.longest
        )
    got = {
        "out": _error(output.transpose(1, 2), want.output),
        "lse": _error(lse.transpose(1, 2), want.lse),
    }
    for name, grad, exact in zip(("dq", "dk", "dv"), grads, want.grads, strict=True):
        got[name] = _error(grad.transpose(1, 2), exact)
    return got


def _take(tensor: torch.Tensor, index: Index) -> torch.Tensor:
    return tensor[index] if isinstance(index, slice) else tensor.index_select(0, index)


def _add(whole: torch.Tensor, part: torch.Tensor, index: Index) -> None:
    if isinstance(index, slice):
        whole[index] += part
    else:
        whole.index_add_(0, index, part)


@dataclass
class _Ring:
    """A case's ring: each rank's local tokens of the reference's tensors, and its plan."""

    plan: RingPlan
    positions: list[torch.Tensor]
    contract: FlashContract  # entered around the kernel calls alone: the rest runs as is

    def tokens(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """A ring rank's local tokens [B * L, H, ...], its rows laid end to end."""
        return tensor[:, self.positions[rank]].flatten(0, 1)

    def forward(self, want: Tensors, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s output and log-sum-exp: its rounds against every block, merged."""
        query = self.tokens(want.query, rank)
        output = torch.zeros_like(query)
        lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float64)
        for source, rounds in enumerate(self.plan.rounds[rank]):
            key, value = self.tokens(want.key, source), self.tokens(want.value, source)
            for round_ in rounds:
                q_index, k_index = round_.q_index, round_.k_index
                q, k, v = _take(query, q_index), _take(key, k_index), _take(value, k_index)
                with self.contract:
                    block, block_lse = ring_flash_forward(q, k, v, round_, SCALE)
                held, held_lse = _take(output, q_index), _take(lse, q_index)
                merged = torch.logaddexp(held_lse, block_lse)
                held = held * (held_lse - merged).exp().unsqueeze(-1)
                held = held + block * (block_lse - merged).exp().unsqueeze(-1)
                output[q_index], lse[q_index] = held, merged
        return output, lse

    def backward(
        self, want: Tensors, rank: int, output: torch.Tensor, lse: torch.Tensor, grads: list
    ) -> None:
        """Add rank `rank`'s rounds' shares to the query gradient of its tokens and the key
        and value gradients of every block's: `grads[r]` is rank r's (dq, dk, dv)."""
        query, grad_output = self.tokens(want.query, rank), self.tokens(want.grad_output, rank)
        for source, rounds in enumerate(self.plan.rounds[rank]):
            key, value = self.tokens(want.key, source), self.tokens(want.value, source)
            for round_ in rounds:
                q_index, k_index = round_.q_index, round_.k_index
                arguments = [
                    _take(tensor, index)
                    for tensor, index in (
                        (grad_output, q_index),
                        (query, q_index),
                        (key, k_index),
                        (value, k_index),
                        (output, q_index),
                        (lse, q_index),
                    )
                ]
                with self.contract:
                    part_q, part_k, part_v = ring_flash_backward(*arguments, round_, SCALE)
                _add(grads[rank][0], part_q, q_index)
                _add(grads[source][1], part_k, k_index)
                _add(grads[source][2], part_v, k_index)


def ring_errors(case: AttentionCase, seed: int = 0) -> dict[str, float]:
    """Ring attention's CUDA path: every ring rank's rounds against every block through the
    contract, merged as ring attention merges them, forward and backward."""
    batch = sp_batch(case)
    want = reference(case, batch, seed)
    documents = batch.documents(case.batch)
    packed = batch.cu_seqlens is not None
    plan = ring_plan(case.ring, batch.seq // case.ring, documents, case.window, packed)
    layout = chunk_layout(case.ring, batch.seq, documents if packed else None)
    ring = _Ring(plan, [layout.positions(r) for r in range(case.ring)], FlashContract())
    grads = [
        [torch.zeros_like(ring.tokens(t, rank)) for t in (want.query, want.key, want.value)]
        for rank in range(case.ring)
    ]
    errors = dict.fromkeys(("out", "lse", "dq", "dk", "dv"), 0.0)
    for rank in range(case.ring):
        output, lse = ring.forward(want, rank)
        errors["out"] = max(errors["out"], _error(output, ring.tokens(want.output, rank)))
        errors["lse"] = max(errors["lse"], _error(lse, ring.tokens(want.lse, rank)))
        ring.backward(want, rank, output, lse, grads)
    for rank in range(case.ring):
        for name, got, exact in zip(("dq", "dk", "dv"), grads[rank], want.grads, strict=True):
            errors[name] = max(errors[name], _error(got, ring.tokens(exact, rank)))
    return errors
