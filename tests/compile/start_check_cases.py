"""What every rank of a pool runs in the start-check tests: the job's own check over groups
laid out as a job lays them, or verify's comparison in bf16."""

import os
from dataclasses import asdict

import torch
from pool_dims import pool_dims

from slurm_autosp.config import DocumentBoundaries, JobConfig, load_config
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.verify import VerifyOptions
from slurm_autosp.verify.options import Inject
from slurm_autosp.verify.ranks import compare_sp_step, full_fp32
from slurm_autosp.verify.start_check import INJECT_ENV, StartCheckFailed, run_start_check

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_cpu.yaml")


def _config(overrides: list[str], masked: bool) -> JobConfig:
    """tiny_cpu with `overrides`; `masked`: its data's documents masked (which a prepared
    directory would need: the check makes its own rows)."""
    cfg = load_config([f"cfg={TINY}", *overrides])
    if masked:
        cfg.data.documents = DocumentBoundaries.masked
    return cfg


def job_start_check(overrides: list[str], masked: bool, inject: str = "none") -> dict:
    """The job's start check over the whole pool as SP groups of parallel.sp_size: its record,
    or the failure's message."""
    cfg = _config(overrides, masked)
    RunDir(cfg.run.dir).root.mkdir(parents=True, exist_ok=True)
    os.environ[INJECT_ENV] = inject
    try:
        check = run_start_check(cfg, pool_dims(cfg.parallel.sp_size, cfg.parallel.ring_size or 1))
    except StartCheckFailed as failed:
        return {"failed": str(failed)}
    finally:
        del os.environ[INJECT_ENV]
    return asdict(check) if check is not None else {}


def bf16_comparison(documents: int, inject: str = "none") -> dict | None:
    """verify's comparison with the AutoSP step in bf16 (what a GPU runs where its kernels
    compute nothing else), on rank 0 its worst error and bf16's own."""
    cfg = load_config([f"cfg={TINY}"])
    options = VerifyOptions(documents=documents, inject=Inject(inject))
    with full_fp32():
        report = compare_sp_step(cfg, options, pool_dims(cfg.parallel.sp_size), torch.bfloat16)
    if report is None:
        return None
    return {"worst": report.worst_error, "baseline": report.baseline_error}
