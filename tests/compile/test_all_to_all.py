"""The Ulysses all-to-all moves exactly the right data, both ways and in backward."""

import pytest
import torch
from all_to_all_cases import scatter_heads_gather_sequence
from torch.fx.experimental.proxy_tensor import make_fx

from slurm_autosp.sp import current_sp_group, set_sp_group, sp_all_to_all


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_all_to_all_gathers_sequence_in_rank_order_and_inverts(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    for result in pool.run(scatter_heads_gather_sequence):
        assert result == {"forward": 0.0, "inverse": 0.0, "backward": 0.0}


def test_all_to_all_without_a_registered_group_says_how_to_set_one():
    set_sp_group(None)
    with pytest.raises(RuntimeError, match="set_sp_group"):
        current_sp_group()


def test_all_to_all_fake_impl_follows_a_symbolic_sequence_length():
    round_trip = make_fx(
        lambda t: sp_all_to_all(sp_all_to_all(t, 1, 2, 2), 2, 1, 2), tracing_mode="symbolic"
    )(torch.randn(1, 4, 6, 2))
    shard, gathered, restored = [
        n.meta["val"].shape
        for n in round_trip.graph.nodes
        if n.op in ("placeholder", "call_function")
    ]
    seq = shard[2].node.expr
    assert (gathered[1], gathered[2].node.expr) == (2, 2 * seq)
    assert (restored[1], restored[2].node.expr) == (4, seq)
