"""Cross-entropy over the vocabulary in chunks of tokens, so the [tokens, vocab] logits never
exist whole (at 16k tokens per rank and a 128k vocabulary, fp32 logits alone are 8 GB).

Each chunk's logits are computed, reduced to a summed loss and dropped; backward recomputes
one chunk at a time (activation checkpointing per chunk), so at most one chunk's logits and
their gradient are alive. The arithmetic is Hugging Face's causal-LM loss: logits in the
model's dtype, cast to fp32, summed cross-entropy over valid labels, divided by the step's
global label count; only the order of the fp32 summation differs. Training, evaluation and
verify all assemble their loss here, an MoE's router load-balancing loss included (its exact
share on each SP rank: router_loss).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from slurm_autosp.sp.inputs import IGNORE_INDEX
from slurm_autosp.sp.router_loss import RouterTokens, load_balancing_of

LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
)  # a scale of 1 is no transform


def unsupported_logits(config: Any) -> list[str]:
    """HF config fields that make the model transform its logits after the output embedding: the
    chunked loss computes plain `hidden @ weight.T` and would silently skip them."""
    values = {field: getattr(config, field, None) for field in LOGIT_TRANSFORMS}
    return [
        f"{field}={value}: the chunked loss does not apply the model's transform of its logits"
        for field, value in values.items()
        if value is not None and not (field != "final_logit_softcapping" and value == 1)
    ]


def _chunk_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int,
    *,
    chunk_tokens: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum over tokens of CE(hidden @ weight.T + bias, labels) / num_items_in_batch.

    `hidden` is [..., H] (the final norm's output), `labels` [...] already shifted, with
    IGNORE_INDEX for tokens outside the loss. `chunk_tokens` <= 0 computes all at once.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    tokens = hidden.shape[0]
    chunk = tokens if chunk_tokens <= 0 else min(chunk_tokens, tokens)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        if chunk >= tokens:
            total = total + _chunk_loss_sum(hidden, weight, bias, labels)
        else:
            total = total + checkpoint(
                _chunk_loss_sum,
                hidden[start:end],
                weight,
                bias,
                labels[start:end],
                use_reentrant=False,
            )
    return total / torch.as_tensor(num_items_in_batch, device=total.device)


@contextmanager
def _output_embedding_as_identity(module: torch.nn.Module) -> Iterator[torch.nn.Linear | None]:
    """Swap the model's output embedding for an identity for the duration of a forward, so its
    `logits` are the final hidden states; yields the real output embedding (None if the model
    has no plain Linear one)."""
    get_output_embeddings = getattr(module, "get_output_embeddings", None)
    head = get_output_embeddings() if get_output_embeddings is not None else None
    name = next((n for n, child in module.named_children() if child is head), None)
    if not isinstance(head, torch.nn.Linear) or name is None:
        yield None
        return
    setattr(module, name, torch.nn.Identity())
    try:
        yield head
    finally:
        setattr(module, name, head)


def _logits_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int
) -> torch.Tensor:
    """Hugging Face's causal-LM loss on logits already computed: fp32 cross-entropy summed over
    valid labels (already shifted) / num_items_in_batch."""
    total = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total / torch.as_tensor(num_items_in_batch, device=total.device)


def causal_lm_loss(
    model: Any,
    batch_kwargs: dict[str, Any],
    *,
    chunk_tokens: int,
    router: RouterTokens | None = None,
) -> torch.Tensor:
    """`causal_lm_forward`'s loss."""
    return causal_lm_forward(model, batch_kwargs, chunk_tokens=chunk_tokens, router=router)[0]


def causal_lm_forward(
    model: Any,
    batch_kwargs: dict[str, Any],
    *,
    chunk_tokens: int,
    router: RouterTokens | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss of an HF causal LM on `SPBatch.model_kwargs()`, computed in chunks, and its
    logits (None when computed in chunks: they never exist whole).

    `model` is what runs the forward (the DeepSpeed engine, so its backward hooks are set on the
    outputs). The output embedding is swapped for an identity during the forward, so the model
    returns its final hidden states as `logits` (without labels it computes no loss of its own);
    the loss is then `chunked_cross_entropy` with the real output embedding. A model without a
    Linear output embedding, or chunk_tokens <= 0, takes the model's own loss.

    An MoE with a router load-balancing loss (`output_router_logits`) is run without labels, so
    it adds no aux of its own (on a shard, the wrong one); the cross-entropy comes from its
    logits, plus, with `router`, this rank's exact share of the aux (`router_loss`). Without
    `router` the loss is the cross-entropy alone (evaluation: its perplexity).
    """
    module = getattr(model, "module", model)
    problems = unsupported_logits(getattr(module, "config", None))
    if chunk_tokens > 0 and problems:
        raise ValueError(
            "; ".join(problems)
            + "; compute the loss unchunked (chunk_tokens=0, compile.loss_chunk_tokens=0)"
        )
    balancing = load_balancing_of(module)
    kwargs = {
        k: v
        for k, v in batch_kwargs.items()
        if k not in ("labels", "shift_labels", "num_items_in_batch")
    }
    chunked: AbstractContextManager[torch.nn.Linear | None] = (
        _output_embedding_as_identity(module) if chunk_tokens > 0 else nullcontext(None)
    )
    with chunked as head:
        if head is None and balancing is None:
            out = model(**batch_kwargs)
            return out.loss, out.logits
        out = model(**kwargs)
    labels, count = batch_kwargs["shift_labels"], batch_kwargs["num_items_in_batch"]
    if head is None:
        loss, logits = _logits_cross_entropy(out.logits, labels, count), out.logits
    else:
        loss = chunked_cross_entropy(
            out.logits, head.weight, labels, count, chunk_tokens=chunk_tokens, bias=head.bias
        )
        logits = None
    if balancing is not None and router is not None:
        loss = loss + balancing.share(out.router_logits, router)
    return loss, logits
