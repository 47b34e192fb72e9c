"""A job's exactness check before step 1: run on its own ranks over its own groups, with its
model's attention pattern, stopping every rank on a mismatch, recorded and not repeated.
(The end-to-end job: tests/test_local_run.py and tests/test_start_check_job.py.)"""

import json

import pytest
import torch
import transformers

from slurm_autosp.config import load_config
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.verify.start_check import FACTOR, FLOOR, StartCheck, _recorded
from tests.compile.start_check_cases import TINY

MISTRAL = [
    "model.model_type=mistral",
    "model.extra={sliding_window: 4096}",
]


def _record(run_dir, **changes) -> None:
    check = {
        "passed": True,
        "compared": "llama shrunk to 2 layers",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "worst_error": 1e-7,
        "tolerance": 1e-5,
        "seconds": 5.0,
        "report": "",
        **changes,
    }
    RunDir(run_dir).start_check.write_text(json.dumps(check))


def test_a_passed_check_with_the_same_versions_is_not_repeated(tmp_path):
    cfg = load_config([f"cfg={TINY}", f"run.output_root={tmp_path}"])
    RunDir(cfg.run.dir).root.mkdir(parents=True)
    _record(cfg.run.dir)
    assert isinstance(_recorded(cfg.run, "llama shrunk to 2 layers"), StartCheck)
    assert _recorded(cfg.run, "llama shrunk to 2 layers, SP 4") is None  # another comparison
    for changed in ({"torch": "2.11.0"}, {"transformers": "5.17.0"}, {"passed": False}):
        _record(cfg.run.dir, **changed)
        assert _recorded(cfg.run, "llama shrunk to 2 layers") is None, changed
    RunDir(cfg.run.dir).start_check.write_text('{"passed": tr')  # cut short
    assert _recorded(cfg.run, "llama shrunk to 2 layers") is None


@pytest.mark.slow
def test_the_check_keeps_the_jobs_windows_and_documents_and_stops_every_rank_on_a_mismatch(
    pool2, tmp_path
):
    """A windowed model on masked documents: the shrunk copy windows within documents shorter
    than its sequence. Passed, it is recorded and the next start reads it; with the shard
    boundary bug every rank raises verify's report."""
    overrides = [*MISTRAL, f"run.output_root={tmp_path}"]
    first = pool2.run("tests.compile.start_check_cases:job_start_check", overrides, True)
    assert first[0] == first[1]
    assert first[0]["passed"], first[0]["report"]
    assert "3 packed documents and a window of 15" in first[0]["compared"]
    assert "SP 2 x DP 1 on cpu in float32" in first[0]["compared"]
    assert first[0]["worst_error"] <= 1e-5
    again = pool2.run("tests.compile.start_check_cases:job_start_check", overrides, True)
    assert again[0] == first[0]  # read back, not run again (the same seconds)

    injected = pool2.run(
        "tests.compile.start_check_cases:job_start_check", overrides, True, "per_shard_shift"
    )
    for rank in injected:
        assert rank["failed"].startswith("exactness check: FAILED"), rank
        assert "INJECTED BUG per_shard_shift" in rank["failed"]
        assert "the label pair crossing each shard boundary is lost" in rank["failed"]
    recorded = json.loads((tmp_path / "tiny_cpu" / "start_check.json").read_text())
    assert recorded["passed"] is False and "FAIL:" in recorded["report"]


@pytest.mark.slow
def test_a_bf16_check_is_held_to_what_bf16_costs_the_model_on_one_device(pool2):
    """Where a GPU computes documents, windows and the ring only in bf16, the AutoSP step runs
    in bf16: exact SP errs about as much as the model in bf16 on one device; the shard
    boundary bug errs far more."""
    exact = pool2.run("tests.compile.start_check_cases:bf16_comparison", 3)[0]
    assert 0 < exact["baseline"] and exact["worst"] <= FACTOR * exact["baseline"] + FLOOR, exact
    wrong = pool2.run("tests.compile.start_check_cases:bf16_comparison", 3, "per_shard_shift")[0]
    assert wrong["worst"] > 10 * (FACTOR * wrong["baseline"] + FLOOR), wrong
