"""Stops inside a step: every rank leaves it at the same decoder-layer boundary, forward or
backward, two boundaries after the signal at most, whichever rank got it; a step nobody stops
passes every boundary and is untouched; a real USR2 stops a backward run as on CUDA (on another
thread, the main thread waiting in C++). On a real tiny Llama, eager and per-layer compiled."""

import pytest

from tests._dist_pool import dist_pools as dist_pools  # the session's pools
from tests.layer_stop_cases import LAYERS, armed_step

ALL = list(range(LAYERS))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_stop_in_forward_ends_the_step_two_boundaries_later(single_rank_group, compiled):
    outcome = armed_step("forward", [0], compiled)
    # asked inside layer 1: layer 2's boundary starts the agreement that layer 3's finds
    assert outcome.interrupted
    assert outcome.forward_layers == [0, 1, 2]
    assert outcome.boundaries == 4
    assert outcome.layers_with_grads == []


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_stop_in_backward_ends_it_before_the_first_layers_gradients(single_rank_group, compiled):
    outcome = armed_step("backward", [0], compiled)
    # backward's boundaries: layer 3's output gradient starts the agreement, layer 2's finds it
    assert outcome.interrupted
    assert outcome.boundaries == LAYERS + 2
    assert outcome.layers_with_grads == [3]


def test_no_stop_passes_every_boundary(single_rank_group):
    outcome = armed_step("none", [], compiled=False)
    assert not outcome.interrupted
    assert outcome.boundaries == 2 * LAYERS
    assert outcome.layers_with_grads == ALL


@pytest.mark.parametrize("stop_in", ["forward", "backward"])
def test_one_ranks_signal_stops_every_rank_at_the_same_boundary(dist_pools, stop_in):
    outcomes = dist_pools(2).run("layer_stop_cases:armed_step", stop_in, [1], True)
    assert all(o.interrupted for o in outcomes)
    assert len({o.boundaries for o in outcomes}) == 1
    assert outcomes[0].forward_layers == outcomes[1].forward_layers
    assert outcomes[0].layers_with_grads == outcomes[1].layers_with_grads


def test_usr2_in_a_backward_on_another_thread_stops_every_rank_two_boundaries_on(dist_pools):
    # as on CUDA, where autograd's device threads run the backward and the main thread waits
    # in C++: rank 1's signal comes inside layer 3's backward, layer 2's output gradient (the
    # next boundary) starts the agreement with it, layer 1's finds it, on both ranks
    outcomes = dist_pools(2).run("layer_stop_cases:usr2_in_a_backward_run_as_on_cuda", 1)
    for outcome in outcomes:
        assert outcome.interrupted, "the stop came after the step"
        assert outcome.boundaries == LAYERS + 3
        assert outcome.layers_with_grads == [2, 3]
