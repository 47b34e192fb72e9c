"""The plan's choices are decided once, at submission (or a hand-submitted job's first start),
and written into the run's config: later starts and requeues never plan again."""

import subprocess
import sys
from pathlib import Path

import pytest
from first_start import FROZEN, record_first_start

import slurm_autosp.memory_plan.choose as choose
from slurm_autosp.commands.run import admit_start
from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.config import ActivationCheckpointing, ConfigError, StopAt, load_config, to_yaml
from slurm_autosp.memory_plan import TrainingChoices, plan_verdict, training_choices
from slurm_autosp.memory_plan.freeze import FROZEN_KEYS, freeze_choices

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_replanning(monkeypatch):
    def refuse(cfg):
        raise AssertionError("planned again")

    monkeypatch.setattr(choose, "build_plan", refuse)


def frozen_llama70b(tmp_path):
    cfg = load_config(["cfg=configs/llama70b_128k.yaml", f"run.output_root={tmp_path}"])
    plan = plan_verdict(cfg)
    return freeze_choices(cfg, plan.choices), plan.choices


def test_every_choice_the_plan_makes_is_written_into_the_config(tmp_path, no_replanning):
    cfg, choices = frozen_llama70b(tmp_path)
    assert choices == TrainingChoices(
        3,
        ActivationCheckpointSpec(ActivationCheckpointing.full, recompute_all_to_all=True),
        0,
        False,
        False,
        True,
        StopAt.layer,  # a 494 s step stops at layer boundaries
        1,  # and saves every step
    )
    written = tmp_path / "config.yaml"
    written.write_text(to_yaml(cfg))
    reloaded = load_config([f"cfg={written}"])
    frozen = [getattr(getattr(reloaded, section), key) for section, key in FROZEN_KEYS]
    # ring 1: SP=8 is Ulysses alone; the budget applies to sac only
    assert frozen == [1, 3, "full", None, True, 0, False, False, True, "layer", 1]
    assert training_choices(reloaded) == choices  # no plan: build_plan would raise


def test_a_requeued_hand_submitted_job_trains_with_what_its_first_start_froze(
    tmp_path, no_replanning
):
    record_first_start("cfg=configs/llama8b_32k.yaml", tmp_path)
    loaded = load_config(["cfg=configs/llama8b_32k.yaml", f"run.output_root={tmp_path}"])
    requeued = admit_start(loaded, restarted=True).cfg
    assert training_choices(requeued) == FROZEN


def test_a_first_start_plans_and_refuses_a_job_that_does_not_fit(tmp_path):
    cfg = load_config(
        ["cfg=configs/llama70b_128k.yaml", f"run.output_root={tmp_path}", "parallel.zero_stage=1"]
    )
    with pytest.raises(
        ConfigError, match=r"the job does not fit its GPUs: needs [\d.]+ GB per GPU under ZeRO-1"
    ):
        admit_start(cfg, restarted=False)


@pytest.mark.slow
def test_run_refuses_a_job_that_does_not_fit_on_every_rank_before_anything_is_written(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slurm_autosp",
            "run",
            "cfg=configs/llama70b_128k.yaml",
            "parallel.zero_stage=1",
            f"run.output_root={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": str(Path(sys.executable).parent), "SLURM_PROCID": "1"},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: the job does not fit its GPUs" in proc.stderr
    assert list(tmp_path.iterdir()) == []
