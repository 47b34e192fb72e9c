"""Whole optimizer steps with AutoSP equal single-device training: gradient accumulation over
SP x DP ranks, steps through the real engines (DeepSpeed ZeRO-1, FSDP2 parameter sharding), and
bf16 within single-device bf16 error. Rank-side code is in train_cases.py; the pools and compiled graphs are shared with the
SP equivalence tests."""

import math

import pytest
from sp_cases import tiny_model
from train_cases import (
    bf16_errors,
    engine_steps,
    fsdp2_export,
    fsdp2_held_bytes,
    grad_accum_step,
    lora_bf16,
    pretrained_under_fsdp2,
    sharded_init,
)

TOLERANCE = 1e-5


@pytest.mark.slow
def test_grad_accum2_dp2_sp2_equals_one_single_device_batch_of_4_sequences(pool4):
    result = pool4.run(grad_accum_step, 2, 2)[0]
    assert result["loss_rel_error"] <= TOLERANCE, result
    assert result["grad_rel_error"] <= TOLERANCE, result


def assert_steps_match(result: dict) -> None:
    assert max(result["loss_rel_errors"]) <= TOLERANCE, result
    assert result["param_rel_error"] <= 1e-2, result
    clipped = min(result["ref_grad_norms"]) > result["grad_clip"]
    assert clipped, (
        f"gradient clipping did not engage at every step, so it was not tested: {result}"
    )


# SP=2 on two ranks is the fast tier's SP equivalence case for each engine; SP=2 x DP=2 is slow.
WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world", WORLDS, ids=["sp2", "sp2_dp2"])
def test_three_zero1_steps_match_torch_adamw_on_one_device(world, request):
    """SP=2 (x DP=2 on four ranks) with grad_accum=2: the loss scale world * grad_accum must undo
    exactly how DeepSpeed ZeRO-1 reduces gradients, or the losses of steps 2 and 3 and the
    weights drift."""
    pool = request.getfixturevalue(f"pool{world}")
    assert_steps_match(pool.run(engine_steps, 1, 2, 2, 3)[0])


@pytest.mark.parametrize("world", WORLDS, ids=["sp2", "sp2_dp2"])
def test_three_fsdp2_steps_match_torch_adamw_on_one_device(world, request):
    """Parameter sharding (zero_stage=3) over every rank, SP=2 (x DP=2 on four ranks), two
    micro-batches per step: the loss scale is FSDP2's mesh size, with no accumulation factor.
    The first step's gradients, gathered from their shards, are the single-device ones."""
    pool = request.getfixturevalue(f"pool{world}")  # the fast tier never starts four ranks
    result = pool.run(engine_steps, 3, 2, 2, 3)[0]
    assert result["grad_rel_error"] <= TOLERANCE, result
    assert_steps_match(result)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 3], ids=["zero1", "fsdp2"])
def test_lora_steps_train_the_single_device_adapters_and_leave_the_base(pool2, zero_stage):
    """LoRA adapters on every projection, SP=2, two micro-batches a step, under each engine:
    the losses and the adapters are single-device AdamW's, and every base weight stays as it
    was (no gradient, no optimizer state for it)."""
    result = pool2.run(engine_steps, zero_stage, 2, 2, 3, 1, True)[0]
    assert_steps_match(result)
    assert result["trained"] and all(".lora_" in name for name in result["trained"]), result
    assert result["frozen"] > 0 and result["frozen_moved"] == 0.0, result
    if zero_stage == 3:
        assert result["grad_rel_error"] <= TOLERANCE, result


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 3], ids=["zero1", "fsdp2"])
def test_a_lora_model_in_bf16_keeps_its_base_in_bf16_and_trains_its_adapters(pool2, zero_stage):
    """ZeRO-1: the bf16 model, adapters included, their fp32 masters DeepSpeed's
    (BF16_Optimizer). FSDP2: the frozen base sharded in bf16 (half its bytes: it has no
    optimizer step to keep fp32 for), the adapters in fp32. Both checkpoints hold the adapters
    alone."""
    result = pool2.run(lora_bf16, zero_stage)[0]
    adapters = "torch.bfloat16" if zero_stage == 1 else "torch.float32"
    assert result["frozen"] == {"torch.bfloat16"} and result["adapters"] == {adapters}
    assert all(math.isfinite(loss) for loss in result["losses"]), result
    assert all(norm > 0 for norm in result["grad_norms"]), result
    assert result["saved"] and all(".lora_" in name for name in result["saved"]), result


def test_fsdp2_meta_device_build_draws_whole_tensors_and_restores_buffers(pool2):
    """Not the CPU build's values (its constructors draw too), but its distributions, norms
    and rotary frequencies, and shards that are slices of one draw."""
    result = pool2.run(sharded_init)[0]
    assert result["keys_equal"] and result["rotary_equal"] and result["norms_one"], result
    assert result["shards_differ"], result
    assert abs(result["linear_std"] - result["config_std"]) < 0.1 * result["config_std"], result


def test_fsdp2_rank_holds_16_bytes_per_parameter_over_the_world(pool2):
    """What the memory plan assumes under zero_stage=3: fp32 weights, fp32 gradients and Adam's
    two fp32 moments, each 1/world per rank (FSDP2 pads shards to equal rows: allow 1%)."""
    for held in pool2.run(fsdp2_held_bytes):
        share = held["parameters"] / 2
        for name, per_param in (("weights", 4), ("grads", 4), ("adam", 8)):
            assert per_param * share <= held[name] <= 1.01 * per_param * share, (name, held)


def test_fsdp2_loads_a_pretrained_checkpoint_into_its_shards(pool2, tmp_path):
    tiny_model("llama", 2).save_pretrained(tmp_path)
    result = pool2.run(pretrained_under_fsdp2, str(tmp_path))[0]
    assert all(result.values()), result


def test_fsdp2_export_streams_shards_that_load_with_the_sharded_models_logits(pool2, tmp_path):
    """Gathered one tensor at a time, into safetensors shards of at most 100 kB (the tiny
    model's 0.36 MB in four), the tied head written once, as save_pretrained writes it."""
    result = pool2.run(fsdp2_export, str(tmp_path), 100_000)[0]
    shards = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert result["files"] == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json", *shards]
    )
    assert result["logits_error"] == 0.0, result
    assert result["tied"] and result["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 3], ids=["bf16_model", "fsdp2_mixed_precision"])
def test_sp2_bf16_error_is_at_most_twice_single_device_bf16_error(pool2, zero_stage):
    """Errors against the fp32 single-device reference (definitions in train_cases.bf16_errors):
    SP in bf16 may round differently from one device in bf16, but not worse than 2x; so may
    FSDP2's bf16 compute over fp32 shards."""
    result = pool2.run(bf16_errors, 2, zero_stage)[0]
    single, sp = result["single_bf16"], result["sp_bf16"]
    for metric in ("loss", "token_rms", "grad_norm"):
        assert sp[metric] <= 2 * single[metric], (
            f"{metric}: SP bf16 {sp[metric]:.2e} > 2 x single-device bf16 {single[metric]:.2e}; {result}"
        )
