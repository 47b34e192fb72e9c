"""Parameter sharding spike: the AutoSP backend, compiled per decoder layer, trains exactly the
single-device objective inside the real engines, with the loss scale each engine's gradient
reduction needs (sharding_cases.engine_loss_scale).

World 2: the SP group is both ranks, and the engine shards parameters (ZeRO-3, FSDP2) over the
same two ranks. (The spike's ZeRO-1 case became the real engines' tests in
test_training_equivalence.py.) Two micro-batches per step, so the scale is
checked against gradient accumulation too. See docs/sharding_spike.md for the choice.
"""

import pytest
from sharding_cases import sharded_sp_step
from sp_cases import Case

from tests._dist_pool import DistPool

# Its own two ranks: slow. The fast tier's SP case per engine is in test_training_equivalence.
pytestmark = pytest.mark.slow
TOLERANCE = 1e-5
CASE = Case(per_layer=True, labels="uneven")


@pytest.fixture(scope="module")
def own_pool2(tmp_path_factory):
    """Two ranks of their own: DeepSpeed keeps process-wide state (its comm backend, ZeRO-3
    hooks) that should not reach the other compile tests' shared pool."""
    pool = DistPool(2, str(tmp_path_factory.mktemp("sharding_inductor_cache")))
    yield pool
    pool.close()


def assert_exact(results: list[dict]) -> None:
    assert all(r["finite"] for r in results), f"a rank's loss is not finite: {results}"
    worst = {key: max(r[key] for r in results) for key in ("loss_rel_error", "grad_rel_error")}
    assert all(value <= TOLERANCE for value in worst.values()), f"errors above {TOLERANCE}: {worst}"


def test_sp2_under_fsdp2_per_layer_matches_single_device(own_pool2):
    results = own_pool2.run(sharded_sp_step, "fsdp2", CASE, 2)
    assert_exact(results)
    # FSDP2's all-gather and reduce-scatter run in its hooks, outside the compiled graphs, and
    # one graph serves every (sharded) decoder layer.
    assert all(r["collectives_in_graphs"] == [] for r in results), results
    assert all(r["graphs_compiled"] <= 1 for r in results), results


def test_sp2_under_deepspeed_zero3_per_layer_matches_single_device(own_pool2):
    # Exact too, but ZeRO-3's per-submodule hooks are compile-disabled: each layer breaks into
    # many graphs (14 for the 2-layer model with torch 2.13 / deepspeed 0.19.8).
    assert_exact(own_pool2.run(sharded_sp_step, "zero3", CASE, 2))
