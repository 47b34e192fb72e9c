"""Every tensor our code makes on the way train -> evaluate -> save -> export names its device:
on a GPU run a tensor made without one is a CPU tensor beside CUDA ones, and the first
evaluation crashed that way (torch.stack of the device's loss sum and a CPU label count).
tests/device_check.py is the stand-in for the GPU's device check; this runs the real path,
one rank on CPU, under both engines."""

import os

import pytest
import torch
from device_check import names_devices

from slurm_autosp.cluster.parallel_dims import build_parallel_dims
from slurm_autosp.config import load_config
from slurm_autosp.data import write_token_file
from slurm_autosp.lifecycle.signals import StopRequest
from slurm_autosp.train import train

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.mark.parametrize("zero_stage", [1, 3], ids=["zero1", "fsdp2"])
def test_train_evaluate_save_and_export_name_the_device_of_every_tensor(
    tmp_path, single_rank_group, zero_stage
):
    held_out = tmp_path / "eval.tokens"
    ids = torch.randint(1, 256, (4 * 64,), generator=torch.Generator().manual_seed(0))
    write_token_file(held_out, ids.numpy(), vocab_size=256)
    cfg = load_config(
        [
            "cluster.tasks_per_node=1",
            f"parallel.zero_stage={zero_stage}",
            "model.vocab_size=256",
            "data.seq_len=64",
            f"data.eval_path={held_out}",
            "train.steps=2",
            "train.eval_every=1",
            "train.eval_samples=2",
            f"run.output_root={tmp_path}",
        ]
    )
    cfg.run.dir.mkdir(parents=True)
    dims = build_parallel_dims(cfg, local_rank=0, device=torch.device("cpu"))
    with names_devices() as unnamed:
        result = train(cfg, dims, StopRequest())
    assert len(result.losses) == 2
    assert (cfg.run.dir / "hf" / "model.safetensors").exists()
    assert unnamed == [], f"tensors made without naming their device: {sorted(set(unnamed))}"
