"""Optimizer offload changes where the optimizer state lives and which kernel steps it, never
what training computes: through both engines (DeepSpeed ZeRO-1 with ZeRO-Offload, FSDP2 with
CPUOffloadPolicy), SP=2 and SP=2 x DP=2, two optimizer steps of two micro-batches with the
state on the host equal those without (losses and every gradient; weights within the fused
AdamW's rounding), and a save and resume in the middle is bitwise the uninterrupted run.
Rank-side code is in optimizer_offload_cases.py; the pools and compiled graphs are shared with
the equivalence tests."""

import pytest
import torch
from optimizer_offload_cases import offload_steps

TOLERANCE = 1e-5
ENGINES = pytest.mark.parametrize("zero_stage", [1, 3], ids=["deepspeed_zero1", "fsdp2"])


def _rel(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference)


def assert_offload_equals_resident(plain: dict, offloaded: dict) -> None:
    """Losses, gradient norms and the first step's gradients within 1e-5; weights within 1e-5 of
    their size (the host step is torch's fused AdamW: the same update, rounded differently,
    well inside 1e-3 of how far two steps moved them)."""
    assert offloaded["offloaded"] and not plain["offloaded"], (offloaded, plain)
    initial = plain["initial"]
    assert all(torch.equal(offloaded["initial"][name], w) for name, w in initial.items())
    for key in ("losses", "grad_norms"):
        errors = [_rel(a, b) for a, b in zip(offloaded[key], plain[key], strict=True)]
        assert max(errors) <= TOLERANCE, (key, offloaded[key], plain[key])
    grad_errors = {  # a LoRA A's first gradient is zero (its B is): so must the other be
        name: float((offloaded["grads"][name] - g).abs().max() / g.abs().max().clamp(min=1e-30))
        for name, g in plain["grads"].items()
    }
    assert max(grad_errors.values()) <= TOLERANCE, grad_errors
    for name, w in plain["weights"].items():
        difference = (offloaded["weights"][name] - w).abs().max()
        assert difference <= TOLERANCE * w.abs().max(), name
        assert difference <= 1e-3 * (w - initial[name]).abs().max(), name


@pytest.mark.slow
@ENGINES
def test_sp2_steps_with_the_optimizer_on_the_host_equal_those_without(pool2, zero_stage):
    plain = pool2.run(offload_steps, zero_stage, 2, 2, 2, False)[0]
    assert_offload_equals_resident(plain, pool2.run(offload_steps, zero_stage, 2, 2, 2, True)[0])


@pytest.mark.slow
@ENGINES
def test_sp2_lora_steps_with_the_optimizer_on_the_host_equal_those_without(pool2, zero_stage):
    """The adapters' state alone on the host; the frozen base stays as it was."""
    plain = pool2.run(offload_steps, zero_stage, 2, 2, 2, False, None, True)[0]
    offloaded = pool2.run(offload_steps, zero_stage, 2, 2, 2, True, None, True)[0]
    assert_offload_equals_resident(plain, offloaded)
    assert plain["grads"] and all(".lora_" in name for name in plain["grads"])


@pytest.mark.slow
@ENGINES
def test_sp2_dp2_steps_with_the_optimizer_on_the_host_equal_those_without(pool4, zero_stage):
    plain = pool4.run(offload_steps, zero_stage, 2, 2, 2, False)[0]
    assert_offload_equals_resident(plain, pool4.run(offload_steps, zero_stage, 2, 2, 2, True)[0])


@pytest.mark.slow
@ENGINES
def test_resuming_with_the_optimizer_on_the_host_is_bitwise_the_uninterrupted_run(
    pool2, zero_stage, tmp_path
):
    uninterrupted = pool2.run(offload_steps, zero_stage, 2, 2, 2, True)[0]
    resumed = pool2.run(offload_steps, zero_stage, 2, 2, 2, True, str(tmp_path / "step1"))[0]
    assert resumed["losses"] == uninterrupted["losses"]
    assert resumed["grad_norms"] == uninterrupted["grad_norms"]
    unequal = [
        name
        for name, w in uninterrupted["weights"].items()
        if not torch.equal(resumed["weights"][name], w)
    ]
    assert not unequal, unequal
