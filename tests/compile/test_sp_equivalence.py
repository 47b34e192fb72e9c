"""SP training equals single-device training: loss, per-token losses and every gradient.

Each rank computes the single-device reference (the plain HF model, fp32, full batch) and one
SP step of a compiled copy, with gradients averaged over the world as DeepSpeed ZeRO-1 does.
"""

import pytest
from sp_cases import Case, sp_step

# The fast tier's SP case per engine is in test_training_equivalence.
pytestmark = pytest.mark.slow
TOLERANCE = 1e-5

SP2_CASES = {
    "plain": Case(),
    "uneven_ignore_index": Case(seq=96, labels="uneven"),
    "first_shard_all_ignored": Case(labels="first_shard_ignored"),
    "right_padding": Case(seq=112, right_padding=True),
    "seq_127_not_divisible_by_sp": Case(seq=127, labels="uneven"),
    "no_position_ids": Case(seq=64, pass_position_ids=False),
    "per_layer_compile": Case(per_layer=True, labels="uneven"),
    "qwen2_one_kv_head": Case(family="qwen2", kv_heads=1),
}


def assert_matches_reference(results: list[dict[str, float]]) -> None:
    """Every rank's loss, per-token losses and gradients within TOLERANCE of the reference."""
    worst = {
        key: max(r[key] for r in results)
        for key in ("loss_rel_error", "token_error", "grad_rel_error")
    }
    assert all(r["finite"] for r in results), f"a rank's loss is not finite: {results}"
    print(f"worst over ranks: {worst}")
    assert all(value <= TOLERANCE for value in worst.values()), f"errors above {TOLERANCE}: {worst}"


@pytest.mark.parametrize("case", SP2_CASES.values(), ids=SP2_CASES.keys())
def test_sp2_loss_and_grads_match_single_device(pool2, case):
    assert_matches_reference(pool2.run(sp_step, case, 2))


def test_sp2_dp2_loss_and_grads_match_single_device(pool4):
    assert_matches_reference(pool4.run(sp_step, Case(batch=4, seq=127, labels="uneven"), 2))
