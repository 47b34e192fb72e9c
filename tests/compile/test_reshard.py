"""A checkpoint resumes on another world size or SP x DP layout, at the same global batch: saved
on 4 ranks as SP=2 x DP=2, resumed on 2 ranks as SP=2 with twice the gradient accumulation and
on 4 ranks as SP=4, under both engines, it takes the steps of the uninterrupted run. ZeRO-1's
layout-free format restores its whole optimizer state bitwise on fewer and more ranks, across
fp32 and bf16 (DeepSpeed's BF16_Optimizer) and with the optimizer moved to or from the host.
Rank-side code is in reshard_cases.py; the pools and compiled graphs are shared with the
equivalence tests."""

import pytest
import torch
from reshard_cases import resumed_run, saved_run, zero1_state_loaded, zero1_state_saved

TOLERANCE = 1e-6
STEPS, SAVE_AFTER = 4, 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("zero_stage", "lora"),
    [(1, False), (3, False), (3, True)],
    ids=["deepspeed_zero1", "fsdp2", "fsdp2_lora"],
)
def test_saved_as_sp2_dp2_resumes_on_2_ranks_and_as_sp4_with_the_uninterrupted_losses(
    pool2, pool4, zero_stage, lora, tmp_path
):
    """LoRA: the checkpoint holds the adapters alone (the frozen base left out of torch's
    distributed checkpoint), and reshards as the whole model's does. ZeRO-1 finds its pieces
    by name whatever trains: its LoRA resume is test_lora_run's."""
    checkpoint = str(tmp_path)
    saved = pool4.run(saved_run, zero_stage, 2, 1, STEPS, SAVE_AFTER, checkpoint, lora)
    uninterrupted = saved[0]
    for pool, sp_size in ((pool2, 2), (pool4, 4)):  # DP=1: grad_accum 2 keeps the global batch
        resumed = pool.run(resumed_run, zero_stage, sp_size, 2, STEPS, checkpoint, lora)[0]
        assert resumed["step"] == SAVE_AFTER
        errors = [
            abs(a - b) / abs(b)
            for a, b in zip(resumed["losses"], uninterrupted[SAVE_AFTER:], strict=True)
        ]
        assert max(errors) <= TOLERANCE, (sp_size, resumed["losses"], uninterrupted, errors)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "offload", "saved_on", "loaded_on"),
    [("fp32", False, 4, 2), ("fp32", True, 2, 4), ("bf16", False, 4, 2), ("bf16", True, 2, 4)],
    ids=["fp32_4_to_2_ranks", "fp32_offloaded_2_to_4", "bf16_4_to_2", "bf16_offloaded_2_to_4"],
)
def test_zero1_state_loads_bitwise_on_another_world_size_and_offload(
    dist_pools, precision, offload, saved_on, loaded_on, tmp_path
):
    """The fp32 master weights and Adam's moments of every parameter, the step and the module's
    weights (bf16 ones too), after a load on `loaded_on` ranks with the optimizer on the other
    side of the host/device line (bf16: DeepSpeed's BF16_Optimizer on one side, its ZeRO
    optimizer on the other)."""
    saved = dist_pools(saved_on).run(zero1_state_saved, precision, offload, str(tmp_path))[0]
    assert saved["deepspeed_agrees"], "the test's gatherer reads what DeepSpeed's does"
    assert saved["step"] == 1.0 and all(v.abs().sum() > 0 for v in saved["whole"].values())
    loaded = dist_pools(loaded_on).run(zero1_state_loaded, precision, not offload, str(tmp_path))[0]
    unequal = [k for k, v in saved["whole"].items() if not torch.equal(loaded["whole"][k], v)]
    assert not unequal, unequal
    assert loaded["module"].keys() == saved["module"].keys()
    assert all(torch.equal(loaded["module"][k], v) for k, v in saved["module"].items())
    assert next(iter(loaded["module"].values())).dtype == (
        torch.bfloat16 if precision == "bf16" else torch.float32
    )
    assert (loaded["step"], loaded["schedule"]) == (saved["step"], saved["schedule"])
