"""Activation offload changes where saved activations wait, never what the backward computes:
losses, gradients and optimizer steps equal those without offload (eager, compiled SP, SP x DP,
both engines), every non-parameter saved tensor goes to host and back and no parameter does,
and the backward keeps only about a layer's worth of them ahead. Rank-side code is in
offload_cases.py; the pools and compiled graphs are shared with the equivalence tests."""

import pytest
import torch
from offload_cases import (
    LAYERS,
    eager_saved_bytes,
    engine_run,
    interleaved_micro_batches,
    sp_offload_step,
)

from slurm_autosp.sp.offload import ActivationOffload

TOLERANCE = 1e-5
EAGER_LAYERS = 4
MIN_BYTES = 4096  # keeps the [1, 127, 1] norm statistics and the token ids in place, moves the rest


@pytest.fixture(scope="module")
def eager() -> dict:
    offload = ActivationOffload(torch.device("cpu"), layers=EAGER_LAYERS, min_bytes=MIN_BYTES)
    nonparameter, parameter = eager_saved_bytes(EAGER_LAYERS)
    return {
        "plain": interleaved_micro_batches(None, EAGER_LAYERS),
        "offloaded": interleaved_micro_batches(offload, EAGER_LAYERS),
        "stats": offload.stats,
        "nonparameter": nonparameter,
        "parameter": parameter,
    }


def test_two_live_offloaded_micro_batches_give_bitwise_the_losses_and_grads_of_no_offload(eager):
    (plain_losses, plain_grads), (losses, grads) = eager["plain"], eager["offloaded"]
    assert losses == plain_losses
    unequal = [name for name, grad in grads.items() if not torch.equal(grad, plain_grads[name])]
    assert not unequal, unequal


def test_every_nonparameter_saved_tensor_from_min_bytes_up_moves_to_host_and_back_and_no_parameter(
    eager,
):
    stats, nonparameter = eager["stats"], eager["nonparameter"]
    moved = sum(n for n in nonparameter if n >= MIN_BYTES)
    assert moved > 0 and sum(eager["parameter"]) > 0, eager
    assert stats.to_host_bytes == stats.to_device_bytes == moved, (stats, moved)
    assert stats.kept_bytes == sum(n for n in nonparameter if n < MIN_BYTES) > 0, stats


def test_backward_holds_one_to_two_layers_of_offloaded_bytes_and_frees_them_all(eager):
    """The prefetch keeps one layer's worth (a micro-batch's offloaded bytes over its layers)
    fetched ahead; eager backward frees each tensor as it is done with it."""
    stats = eager["stats"]
    layer = stats.to_host_bytes / 2 / EAGER_LAYERS
    assert layer <= stats.peak_resident_bytes <= 2 * layer, (stats, layer)
    assert stats.resident_bytes == 0, stats


def test_reading_offloaded_activations_twice_is_refused_with_a_clear_error():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    offload = ActivationOffload(torch.device("cpu"), layers=1, min_bytes=0)
    with offload.saving():
        loss = model(torch.randn(8, 64)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        loss.backward()


@pytest.mark.parametrize("min_bytes", [0, 1 << 20], ids=["offloaded", "kept"])
def test_an_activation_written_in_place_after_it_was_saved_is_refused_as_autograd_refuses_it(
    min_bytes,
):
    """Saved-tensor hooks turn autograd's check of a saved tensor's version off, and on CUDA the
    copy to host runs later, on a side stream: the write could reach the backward silently."""
    x = torch.randn(8, 64, requires_grad=True)
    offload = ActivationOffload(torch.device("cpu"), layers=1, min_bytes=min_bytes)
    with offload.saving():
        y = x.exp()  # saves its output
    y.mul_(2)
    written = r"modified by an inplace operation: \[torch.FloatTensor \[8, 64\]\] is at version 1"
    with pytest.raises(RuntimeError, match=written):
        y.sum().backward()


def assert_sp_offload_exact(results: list[dict]) -> None:
    """Within 1e-5 of the single-device reference; each rank moved exactly what its compiled
    forwards save besides parameters (min_bytes=0), and held at most about two layers of it."""
    errors = results[0]
    assert errors["loss_rel_error"] <= TOLERANCE and errors["grad_rel_error"] <= TOLERANCE, errors
    for stats in results:
        assert stats["saved_parameter_bytes"] > 0, stats
        assert (
            stats["to_host_bytes"]
            == stats["to_device_bytes"]
            == stats["saved_nonparameter_bytes"]
            > 0
        ), stats
        assert stats["kept_bytes"] == 0 and stats["resident_bytes"] == 0, stats
        assert stats["peak_resident_bytes"] <= 2 * stats["per_micro_batch_bytes"] / LAYERS, stats


@pytest.mark.slow
def test_sp2_offloaded_grad_accum2_equals_one_single_device_batch(pool2):
    assert_sp_offload_exact(pool2.run(sp_offload_step, 2, 2))


@pytest.mark.slow
def test_sp2_dp2_offloaded_grad_accum2_equals_one_single_device_batch(pool4):
    assert_sp_offload_exact(pool4.run(sp_offload_step, 2, 2))


def _rel(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 3], ids=["deepspeed_zero1", "fsdp2"])
def test_two_sp2_optimizer_steps_with_offload_equal_those_without(pool2, zero_stage):
    """Two micro-batches per step, the chunked loss's checkpointed chunks inside the offloaded
    forward; weights compared by how far the steps moved them."""
    plain = pool2.run(engine_run, zero_stage, 2, 2, 2, False)[0]
    offloaded = pool2.run(engine_run, zero_stage, 2, 2, 2, True)[0]
    assert offloaded["to_host_bytes"] > 0, offloaded
    initial = plain["initial"]
    assert all(torch.equal(offloaded["initial"][name], w) for name, w in initial.items())
    for key in ("losses", "grad_norms"):
        errors = [_rel(a, b) for a, b in zip(offloaded[key], plain[key], strict=True)]
        assert max(errors) <= TOLERANCE, (key, offloaded[key], plain[key])
    weight_errors = {
        name: float((offloaded["weights"][name] - w).abs().max() / (w - initial[name]).abs().max())
        for name, w in plain["weights"].items()
    }
    assert max(weight_errors.values()) <= TOLERANCE, weight_errors
