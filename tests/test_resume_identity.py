"""A resubmitted run resumes only as the same run: keys that define it must not change (the job
refuses, naming them), others may (the job names them); each submission's config is kept."""

import json
import os
import socket
from pathlib import Path

import pytest
from submitit.core.utils import pickle_load
from torch import nn

from slurm_autosp.checkpoint.identity import differences, dropout_of, is_identity, run_settings
from slurm_autosp.cluster.placement import layout_for
from slurm_autosp.config import load_config
from slurm_autosp.lifecycle.lock import RunLock
from slurm_autosp.lifecycle.run_setup import prepare_run_dir

REPO = Path(__file__).resolve().parents[1]
THIS_PROCESS = RunLock(str(os.getpid()), "local", socket.gethostname())  # a live holder


@pytest.mark.parametrize(
    "key",
    [
        "model.hidden_size",
        "model.vocab_size",
        "model.pretrained_path",
        "model.extra.rope_theta",
        "data.source",
        "data.path",
        "data.seq_len",
        "data.shuffle",
        "data.blend./data/web",
        "train.seed",
        "train.global_batch",
        "train.precision",
        "parallel.zero_stage",
    ],
)
def test_keys_that_define_the_run_are_its_identity(key):
    assert is_identity(key)


@pytest.mark.parametrize(
    "key",
    [
        "train.steps",
        "train.lr",
        "train.lr_schedule",
        "train.min_lr_ratio",
        "train.warmup_steps",
        "train.log_every",
        "checkpoint.every_steps",
        "checkpoint.keep",
        "trace.memory_steps",
        "cluster.time_min",
        "cluster.partition",
        "cluster.nvlink_domain_size",
        "compile.activation_checkpointing",
        "run.output_root",
        # the checkpoints reshard; the global batch, an identity key, holds the data position
        "train.micro_batch",
        "train.grad_accum",
        "parallel.sp_size",
        "parallel.layout",
        "cluster.world_size",
    ],
)
def test_keys_a_resumed_run_may_change_are_not(key):
    assert not is_identity(key)


def settings(*overrides):
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", *overrides])
    return run_settings(cfg, layout_for(cfg), 1)


def test_settings_are_flat_json_with_what_the_run_derives():
    recorded = settings("model.extra={rope_scaling: {type: linear, factor: 2.0}}")
    assert json.loads(json.dumps(recorded)) == recorded
    assert recorded["model.extra.rope_scaling.factor"] == 2.0 and recorded["train.steps"] == 60
    assert recorded["train.global_batch"] == 2 and recorded["cluster.world_size"] == 2
    assert recorded["train.precision"] == "fp32" and recorded["parallel.zero_stage"] == 1
    assert recorded["parallel.layout"].startswith("ParallelLayout(world_size 2 = sp 2 x dp 1")


def test_a_key_one_side_lacks_differs_only_when_the_other_sets_it():
    assert differences({"model.extra.a": None}, {}) == []
    assert [str(d) for d in differences({}, {"model.extra.a": 1})] == ["model.extra.a null -> 1"]


def test_dropout_is_found_in_the_config_and_in_modules():
    """What refuses a resume on another layout (tests/test_checkpoint_store.py)."""
    assert dropout_of(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0))) == []
    assert dropout_of(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))) == [
        "1 dropout modules, the first 1"
    ]


def test_each_submission_keeps_its_config(tmp_path):
    for steps in (10, 20, 30):
        prepare_run_dir(
            load_config([f"run.output_root={tmp_path}", "run.name=r", f"train.steps={steps}"]),
            THIS_PROCESS,
        )
    run_dir = tmp_path / "r"
    assert "steps: 30" in (run_dir / "config.yaml").read_text()
    kept = sorted((run_dir / "configs").iterdir())
    assert [p.name for p in kept] == ["config.0001.yaml", "config.0002.yaml"]
    assert ["steps: 10" in kept[0].read_text(), "steps: 20" in kept[1].read_text()] == [True, True]


def test_kept_configs_are_never_overwritten(tmp_path):
    cfg = load_config([f"run.output_root={tmp_path}", "run.name=r"])
    prepare_run_dir(cfg, THIS_PROCESS)
    (cfg.run.dir / "configs").mkdir()
    (cfg.run.dir / "configs" / "config.0002.yaml").write_text("kept by hand")
    prepare_run_dir(cfg, THIS_PROCESS)
    prepare_run_dir(cfg, THIS_PROCESS)
    assert (cfg.run.dir / "configs" / "config.0002.yaml").read_text() == "kept by hand"
    assert sorted(p.name for p in (cfg.run.dir / "configs").iterdir()) == [
        "config.0002.yaml",
        "config.0003.yaml",
        "config.0004.yaml",
    ]


@pytest.mark.slow
def test_resubmission_with_another_model_is_refused_and_with_more_steps_continues(resubmitted_run):
    other_model = resubmitted_run.refused
    assert other_model.returncode == 2  # at submit, before a job is queued
    assert "submitted job" not in other_model.stdout
    assert "model.hidden_size: 64 in the checkpoint, 96 now" in other_model.stderr
    assert (
        "resume it with the values it was written with (model.hidden_size=64)" in other_model.stderr
    )
    assert "| loss " not in other_model.stdout

    longer, run_dir = resubmitted_run.resumed.stdout, resubmitted_run.run_dir
    assert "resuming with changed settings: train.steps 6 -> 8" in longer
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000003'} at step 3" in longer
    results = (run_dir / "submitit").glob("*_0_result.pkl")
    outcome, result = pickle_load(max(results, key=lambda p: p.stat().st_mtime))
    assert outcome == "success" and result.first_step == 3 and len(result.losses) == 5

    (kept,) = (run_dir / "configs").iterdir()  # the refused submission wrote nothing
    assert "hidden_size: 64" in kept.read_text() and "steps: 6" in kept.read_text()
    assert "steps: 8" in (run_dir / "config.yaml").read_text()
