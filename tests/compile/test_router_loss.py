"""An MoE's router load-balancing loss split over SP ranks: the ranks' shares add up to the
aux Hugging Face computes on one device, value and gradient, padding and SP padding left out."""

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from slurm_autosp.sp import IGNORE_INDEX, prepare_sp_inputs, sp_token_positions
from slurm_autosp.sp.router_loss import (
    LoadBalancing,
    RouterTokens,
    load_balancing_share,
    routing_totals,
)

EXPERTS, TOP_K, LAYERS = 6, 2, 3


def _padded_batch(seq: int, left: bool) -> dict[str, torch.Tensor]:
    """Two rows of `seq` tokens: the first right-padded by 4, the second left-padded by 3 (or
    also right-padded, for a ring, which does not take left padding); a third of the real
    tokens' labels ignored (those tokens still count in the router loss)."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 256, (2, seq), generator=generator)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[0, -4:] = 0
    if left:
        mask[1, :3] = 0
    else:
        mask[1, -2:] = 0
    labels = input_ids.clone()
    labels[:, ::3] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


@pytest.mark.parametrize("sp_size,ring_size", [(2, 1), (3, 1), (4, 2)])
def test_per_rank_shares_sum_to_hfs_aux_value_and_gradient(sp_size, ring_size):
    seq = 13
    batch = _padded_batch(seq, left=ring_size == 1)
    shards = [
        prepare_sp_inputs(**batch, sp_rank=r, sp_size=sp_size, ring_size=ring_size)
        for r in range(sp_size)
    ]
    padded = shards[0].input_ids.shape[1] * sp_size
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(LAYERS, 2, padded, EXPERTS, generator=generator, requires_grad=True)

    positions = [
        sp_token_positions(padded, r, sp_size, ring_size, shards[0].cu_seqlens)
        for r in range(sp_size)
    ]
    probabilities = [
        [torch.softmax(layer[:, p].reshape(-1, EXPERTS), dim=-1) for layer in logits]
        for p in positions
    ]
    for shard, p in zip(shards, positions, strict=True):  # the model's mask, SP padding False
        expected = torch.nn.functional.pad(batch["attention_mask"], (0, padded - seq))[:, p]
        assert torch.equal(shard.real_tokens, expected.bool())
    totals = sum(
        routing_totals(probs, shard.real_tokens, EXPERTS, TOP_K)
        for probs, shard in zip(probabilities, shards, strict=True)
    )
    ours = sum(
        load_balancing_share(probs, shard.real_tokens, totals)
        for probs, shard in zip(probabilities, shards, strict=True)
    )
    (our_grad,) = torch.autograd.grad(ours, logits)

    layers = tuple(layer[:, :seq].reshape(-1, EXPERTS) for layer in logits)
    hf = load_balancing_loss_func(layers, EXPERTS, TOP_K, batch["attention_mask"])
    (hf_grad,) = torch.autograd.grad(hf, logits)
    assert ours.item() == pytest.approx(hf.item(), rel=1e-6)
    assert (our_grad - hf_grad).abs().max() <= 1e-6 * hf_grad.abs().max()
    assert our_grad[:, :, seq:].abs().max() == 0  # SP padding: no gradient, as it is not there


def test_a_share_is_coef_times_the_aux_over_the_steps_micro_batches():
    """One device, 4 micro-batches in the step (e.g. 2 DP replicas x grad_accum 2)."""
    logits = tuple(torch.randn(2, 10, EXPERTS).unbind(0))
    real = torch.ones(2, 5, dtype=torch.bool)
    share = LoadBalancing(EXPERTS, TOP_K, coef=0.02).share(logits, RouterTokens(real, 1, 4))
    hf = load_balancing_loss_func(logits, EXPERTS, TOP_K, None)
    assert float(share) == pytest.approx(0.02 * float(hf) / 4, rel=1e-6)


def test_a_sharded_batch_without_its_sp_group_is_refused():
    logits = (torch.randn(10, EXPERTS),)
    tokens = RouterTokens(torch.ones(2, 5, dtype=torch.bool), sp_size=2, micro_batches=1)
    with pytest.raises(RuntimeError, match="sharded over 2 SP ranks needs their group"):
        LoadBalancing(EXPERTS, TOP_K, coef=0.01).share(logits, tokens)
