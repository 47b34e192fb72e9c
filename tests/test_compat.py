"""slurm_autosp.compat: every private submitit and torch name it wraps still exists upstream,
with the parameters the wrapper passes; an upgrade that renames or removes one fails here."""

import inspect
import os

import submitit
import torch._inductor.runtime.cache_dir_utils as inductor_cache_dir_utils

from slurm_autosp import compat
from slurm_autosp.config import load_config
from slurm_autosp.launch.executor import sbatch_script


def test_submitit_requeue_takes_a_countdown():
    assert list(inspect.signature(submitit.JobEnvironment._requeue).parameters) == [
        "self",
        "countdown",
    ]


def test_submitit_slurm_rendering_names_exist():
    assert callable(submitit.SlurmExecutor._convert_parameters)
    assert "uid" in inspect.signature(submitit.SlurmExecutor._make_submission_file_text).parameters
    assert hasattr(submitit.SlurmExecutor, "_submitit_command_str")


def test_sbatch_text_renders_through_compat():
    script = sbatch_script(load_config(["cfg=configs/llama70b_128k.yaml"]))
    assert script.startswith("#!/bin/bash") and "#SBATCH --nodes=" in script


def test_pickle_load_reads_submitit_result_pickles(tmp_path):
    path = tmp_path / "result.pkl"
    submitit.core.utils.cloudpickle_dump(("success", 42), path)
    assert compat.pickle_load(path) == ("success", 42)


def test_inductor_default_cache_dir_is_what_importing_dynamo_exports(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compat.inductor_default_cache_dir() == inductor_cache_dir_utils.cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == compat.inductor_default_cache_dir()
