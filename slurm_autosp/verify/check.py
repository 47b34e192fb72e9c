"""Run verify's ranks and refuse what they cannot run; the command is commands/verify.py."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.multiprocessing as mp

from slurm_autosp.admission import admit_model
from slurm_autosp.config import ConfigError, JobConfig
from slurm_autosp.model import build_model
from slurm_autosp.verify.options import (
    VerifyOptions,
    shrink_model_config,
    verify_seq_len,
)
from slurm_autosp.verify.packed_rows import verify_layout
from slurm_autosp.verify.ranks import make_batch, run_rank
from slurm_autosp.verify.report import Report


def run_verify(cfg: JobConfig, options: VerifyOptions) -> Report:
    """Spawn sp_size x dp CPU ranks, run the check, return rank 0's report."""
    world_size = cfg.parallel.sp_size * options.dp
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="autosp_verify_") as tmp:
        result_file = os.path.join(tmp, "report.pt")
        mp.spawn(
            run_rank,
            args=(world_size, cfg, options, os.path.join(tmp, "store"), result_file),
            nprocs=world_size,
        )
        return Report(**torch.load(result_file, weights_only=False))


def admit_verify(cfg: JobConfig, options: VerifyOptions) -> None:
    """Refuse (ConfigError) what submit would, and what verify itself cannot run."""
    admit_model(cfg)  # as submit would
    admit_model(cfg, verify_seq_len(cfg.parallel.sp_size, options))  # and what verify runs
    verify_layout(cfg.parallel.sp_size, options)  # one that can be had
    _refuse_a_failing_copy(cfg, options)


def _refuse_a_failing_copy(cfg: JobConfig, options: VerifyOptions) -> None:
    """The shrunk copy runs on one device, without AutoSP, before any rank starts: a model that
    fails on its own (fields that do not fit together, which admission's fake-tensor trace
    could not tell) is named here, not by a rank's traceback."""
    model_cfg = shrink_model_config(cfg.model, options)
    assert model_cfg.vocab_size is not None  # shrink_model_config sets it
    batch = make_batch(1, verify_seq_len(cfg.parallel.sp_size, options), model_cfg.vocab_size, 0)
    try:
        torch.manual_seed(options.seed)
        build_model(model_cfg)(**batch, use_cache=False)
    except Exception as err:  # noqa: BLE001 - the model's own failure, reported by name
        raise ConfigError(
            f"model.model_type={model_cfg.model_type}: verify's shrunk copy ({model_cfg.num_hidden_layers} "
            f"layers, hidden {model_cfg.hidden_size}, head_dim {model_cfg.head_dim}) fails on its own, "
            f"on one device without AutoSP: {type(err).__name__}: {err}. Check the model's fields "
            "(model.*, model.extra.*) fit together"
        ) from err
