"""A tiny Mixtral trained with its router's load-balancing loss (output_router_logits) through
the local executor: SP=2 trains the losses one device trains."""

import pytest
from local_submit import submit_local
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from slurm_autosp.lifecycle.run_dir import RunDir


def _losses(run_dir) -> list[float]:
    events = EventAccumulator(str(RunDir(run_dir).tensorboard))
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


@pytest.mark.slow
def test_mixtral_with_its_router_loss_trains_the_single_device_losses_at_sp2(tmp_path):
    common = (
        "model.model_type=mixtral",
        "model.extra.output_router_logits=true",
        "train.steps=6",
        "train.log_every=1",
        f"run.output_root={tmp_path}",
    )
    sp2 = submit_local(*common, "run.name=sp2")
    assert sp2.returncode == 0, sp2.stdout + sp2.stderr
    one = submit_local(*common, "run.name=sp1", "parallel.sp_size=1", "cluster.tasks_per_node=1")
    assert one.returncode == 0, one.stdout + one.stderr
    sharded, single = _losses(tmp_path / "sp2"), _losses(tmp_path / "sp1")
    assert len(sharded) == len(single) == 6
    assert sharded == pytest.approx(single, rel=1e-5)
    assert single[-1] < single[0]
