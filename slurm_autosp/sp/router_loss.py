"""An MoE router's auxiliary load-balancing loss, exact under sequence parallelism.

Hugging Face's MoE families (`output_router_logits=True`) add coef x aux to the loss, where
aux = E * sum_e f_e * P_e: f_e the fraction of top-k assignments that go to expert e (not
differentiable), P_e the mean router probability of e, both taken over every token of the
micro-batch and every layer (the layers' router logits laid end to end), padding left out.
Computed on an SP shard, the model's own aux is the same formula over that shard's tokens, a
different function whose gradients verify found 0.07-0.9 relative off. aux is linear in P and
f has no gradient, so each rank adds E * sum_e f_e * (its real tokens' summed p_e) / (L * N)
with f's counts and N summed over the SP group (count tensors only, no autograd through the
collective): over the SP ranks these shares sum to the single-device aux, value and gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from slurm_autosp.sp.all_to_all import all_reduce_over_sp, registered_sp_size

# the attributes an HF MoE causal LM keeps and passes its family's load_balancing_loss_func
BALANCING_ATTRIBUTES = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")


@dataclass(frozen=True)
class RouterTokens:
    """What a micro-batch's share of the load-balancing loss needs besides the router logits.

    `real_tokens` [B, S/P] is `SPBatch.real_tokens` (the tokens one device would count).
    `micro_batches` is the number of micro-batches in the optimizer step over all DP replicas
    (dp_size x grad_accum): the step's objective is its cross-entropy plus coef x the MEAN of
    its micro-batches' aux (what one device running each micro-batch computes), so each share is
    divided by it. The engine factor (`loss_scale`) then applies to it as to the cross-entropy:
    ZeRO-1 averages over the world and the micro-batches, so world x grad_accum x coef x share /
    (dp x grad_accum) leaves sp x coef x share, summed over the SP ranks' shares and averaged
    over the DP replicas; FSDP2 averages over the world and sums micro-batches, so its factor
    (world) leaves the same mean.
    """

    real_tokens: torch.Tensor
    sp_size: int
    micro_batches: int


@dataclass(frozen=True)
class LoadBalancing:
    """An MoE's load-balancing loss as its HF causal LM computes it (the arguments it passes
    its family's `load_balancing_loss_func`, and the coefficient on the result)."""

    num_experts: int
    top_k: int
    coef: float

    def share(
        self, router_logits: Sequence[torch.Tensor] | None, tokens: RouterTokens
    ) -> torch.Tensor:
        """coef x this rank's share of its micro-batch's aux / the step's micro-batches."""
        if router_logits is None:
            raise RuntimeError(
                "the model has output_router_logits=True but returned no router_logits: its "
                "load-balancing loss cannot be computed"
            )
        if tokens.sp_size > 1 and registered_sp_size() != tokens.sp_size:
            raise RuntimeError(
                f"the router loss of a batch sharded over {tokens.sp_size} SP ranks needs their "
                f"group registered (set_sp_groups); the registered one has "
                f"{registered_sp_size()} ranks"
            )
        probabilities = _probabilities(router_logits, tokens.real_tokens)
        totals = routing_totals(probabilities, tokens.real_tokens, self.num_experts, self.top_k)
        all_reduce_over_sp(totals)
        share = load_balancing_share(probabilities, tokens.real_tokens, totals)
        return self.coef / tokens.micro_batches * share


def missing_balancing_attributes(model: torch.nn.Module) -> list[str]:
    """Which of the attributes an HF MoE causal LM passes its load-balancing loss it lacks."""
    return [name for name in BALANCING_ATTRIBUTES if getattr(model, name, None) is None]


def load_balancing_of(model: torch.nn.Module) -> LoadBalancing | None:
    """The model's load-balancing loss (None: it computes none, `output_router_logits` off)."""
    if not getattr(getattr(model, "config", None), "output_router_logits", False):
        return None
    missing = missing_balancing_attributes(model)
    if missing:
        raise ValueError(
            f"{type(model).__name__} has output_router_logits=True but keeps no "
            f"{', '.join(missing)}: its load-balancing loss is not one AutoSP computes; set "
            "output_router_logits=false (model.extra.output_router_logits=false)"
        )
    experts, top_k, coef = (getattr(model, name) for name in BALANCING_ATTRIBUTES)
    return LoadBalancing(int(experts), int(top_k), float(coef))


def _probabilities(
    router_logits: Sequence[torch.Tensor], real_tokens: torch.Tensor
) -> list[torch.Tensor]:
    """Each layer's router probabilities, [tokens, E] in the logits' dtype as HF takes them."""
    rows = real_tokens.numel()
    for layer in router_logits:
        if layer.shape[0] != rows:
            raise ValueError(
                f"router logits of {layer.shape[0]} rows for a batch of {tuple(real_tokens.shape)} "
                "tokens: a router that does not score every token once, in batch order, is not "
                "one whose load-balancing loss AutoSP computes"
            )
    return [F.softmax(layer, dim=-1) for layer in router_logits]


def routing_totals(
    probabilities: Sequence[torch.Tensor], real_tokens: torch.Tensor, num_experts: int, top_k: int
) -> torch.Tensor:
    """[E + 1] float64: the top-k assignments of real tokens to each expert summed over the
    layers, then layers x real tokens. No gradient; float64 keeps counts past 2^24 exact."""
    mask = real_tokens.reshape(-1).to(torch.float64)
    weights = mask.repeat_interleave(top_k)
    totals = torch.zeros(num_experts + 1, dtype=torch.float64, device=mask.device)
    for probs in probabilities:
        chosen = torch.topk(probs.detach(), top_k, dim=-1).indices
        totals[:num_experts].scatter_add_(0, chosen.reshape(-1), weights)
    totals[num_experts] = mask.sum() * len(probabilities)
    return totals


def load_balancing_share(
    probabilities: Sequence[torch.Tensor], real_tokens: torch.Tensor, totals: torch.Tensor
) -> torch.Tensor:
    """E * sum_e f_e * (these tokens' summed p_e) / rows, with f and rows from `totals`
    (`routing_totals` summed over the micro-batch's ranks): with this rank's own totals, the
    aux of its tokens alone."""
    num_experts = totals.shape[0] - 1
    mask = real_tokens.reshape(-1, 1).to(torch.float32)
    summed = torch.stack([(p.float() * mask).sum(dim=0) for p in probabilities]).sum(dim=0)
    rows = totals[num_experts].clamp(min=1)
    fraction = (totals[:num_experts] / rows).float()
    return num_experts * (fraction * (summed / rows.float())).sum()


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    real_tokens: torch.Tensor,
) -> torch.Tensor:
    """The aux of one whole micro-batch on one device (its tokens all here)."""
    probabilities = _probabilities(router_logits, real_tokens)
    totals = routing_totals(probabilities, real_tokens, num_experts, top_k)
    return load_balancing_share(probabilities, real_tokens, totals)


def family_difference(
    family: Callable[..., Any], num_experts: int, top_k: int, tolerance: float = 1e-5
) -> str | None:
    """How an HF family's `load_balancing_loss_func(logits, num_experts, top_k, mask)` differs
    from `load_balancing_loss` on random router logits (2 layers, 2 rows of 5 tokens, with and
    without left padding), in value or gradient; None when it does not."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 10, num_experts, generator=generator)
    padding = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    for mask in (None, padding):
        real = torch.ones(2, 5, dtype=torch.bool) if mask is None else mask.bool()
        theirs_in = logits.clone().requires_grad_()
        ours_in = logits.clone().requires_grad_()
        try:
            theirs = family(tuple(theirs_in), num_experts, top_k, mask)
            (their_grad,) = torch.autograd.grad(theirs, theirs_in)
        except Exception as err:  # another signature or semantics: refused, not crashed
            return f"load_balancing_loss_func(logits, num_experts, top_k, mask) fails: {err}"
        ours = load_balancing_loss(tuple(ours_in), num_experts, top_k, real)
        (our_grad,) = torch.autograd.grad(ours, ours_in)
        value_error = ((theirs - ours).abs() / ours.abs().clamp(min=1e-30)).item()
        grad_error = ((their_grad - our_grad).abs().max() / our_grad.abs().max()).item()
        if not max(value_error, grad_error) <= tolerance:
            where = "without" if mask is None else "with"
            return (
                f"its load_balancing_loss_func differs {where} a padding mask (value "
                f"{value_error:.1e}, gradient {grad_error:.1e} relative)"
            )
    return None
