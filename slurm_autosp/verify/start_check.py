"""Every SP job proves, before step 1 and on its own nodes, that AutoSP trains its model as one
device would: verify's comparison (`compare_sp_step`) of the job's model class and config,
shrunk as verify shrinks it, over the job's own Ulysses and ring groups and devices, against
the same batch on one device. A new model family, a new transformers release or a cluster's
own kernels are where a silent error would start; this is where it is caught.

The shrunk copy keeps the job's attention pattern: packed documents when the data is masked,
a window shorter than the check's sequence where the model windows attention. It runs in
fp32 (within verify's 1e-5), except where a GPU's kernels compute only bf16 (flash varlen for
documents, windows and the ring): there the AutoSP step runs in bf16 and may err at most
FACTOR times what bf16 costs the unmodified model on one device, plus FLOOR, and the document
kernel's own bf16 check runs beside it. A passed check is recorded in the run directory with
the torch and transformers versions; a requeue or resubmission that would compare the same
thing with the same versions does not repeat it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import transformers

from slurm_autosp.cluster.parallel_dims import ParallelDims
from slurm_autosp.config import DocumentBoundaries, JobConfig, ModelConfig, RunConfig
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.model import hf_config
from slurm_autosp.sp.attention_pattern import windowed_attention
from slurm_autosp.sp.kernel_check import KernelCheck, check_document_kernel
from slurm_autosp.verify.options import Inject, VerifyOptions, verify_seq_len
from slurm_autosp.verify.ranks import compare_sp_step, full_fp32
from slurm_autosp.verify.report import Report, failures, format_report

log = logging.getLogger(__name__)

# testing hook: a `verify.inject` value the check applies to the job's own comparison
INJECT_ENV = "SLURM_AUTOSP_START_CHECK_INJECT"
DOCUMENTS = 3  # documents per row when the job's data is masked
FACTOR, FLOOR = 2.0, 1e-3  # a bf16 check's bound over the unmodified model's own bf16 error


class StartCheckFailed(RuntimeError):
    """AutoSP does not train this job's model as one device would; the message is verify's
    report. Every rank raises it before step 1."""


@dataclass(frozen=True)
class StartCheck:
    """A check's outcome, as the run directory records it."""

    passed: bool
    compared: str  # the model, pattern, groups and device compared: a repeat compares the same
    torch: str
    transformers: str
    worst_error: float
    tolerance: float
    seconds: float
    report: str

    @property
    def line(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"exactness check: {verdict}: {self.compared}; worst relative error "
            f"{self.worst_error:.1e} (limit {self.tolerance:.0e}); {self.seconds:.1f} s"
        )


def start_check_needed(cfg: JobConfig, dims: ParallelDims) -> bool:
    return cfg.train.start_check and cfg.compile.enabled and dims.sp_size > 1


def run_start_check(cfg: JobConfig, dims: ParallelDims) -> StartCheck | None:
    """Every rank calls it before training; None when the job has no SP or the check is off.
    Returns the check run now or recorded before; raises StartCheckFailed on every rank
    when it fails, after rank 0 has written the report to the run directory."""
    if not start_check_needed(cfg, dims):
        return None
    options, dtype = _options(cfg, dims)
    compared = _compared(cfg.model, dims, options, dtype)
    shared: list[StartCheck | None] = [_recorded(cfg.run, compared) if dims.rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        if dims.rank == 0:
            log.info("%s (recorded before with the same versions: not repeated)", shared[0].line)
        return shared[0]

    start = time.perf_counter()
    with full_fp32():
        report = compare_sp_step(cfg, options, dims, dtype)
    kernels = check_document_kernel(dims.device) if _document_kernel_used(dims, options) else []
    torch._dynamo.reset()  # the job's model compiles afresh: no shapes carried over as dynamic
    by_rank: list[list[KernelCheck]] = [[] for _ in range(dims.world_size)]
    dist.all_gather_object(by_rank, kernels)  # every GPU's kernel, reported by rank 0
    kernels = [replace(k, case=f"{k.case}, rank {r}") for r, ks in enumerate(by_rank) for k in ks]
    check = None
    if report is not None:
        check = _outcome(report, options, compared, time.perf_counter() - start, kernels)
        _record(cfg.run, check)
    shared = [check]
    dist.broadcast_object_list(shared, src=0)
    check = shared[0]
    assert check is not None
    if dims.rank == 0:
        (log.info if check.passed else log.error)("%s", check.line)
    if not check.passed:
        raise StartCheckFailed(
            f"{check.line}\n{check.report}\nThe report is in {RunDir(cfg.run.dir).start_check}; "
            "nothing was trained. Check the model with python -m slurm_autosp verify, train it "
            "without AutoSP (compile.enabled=false, parallel.sp_size=1), or skip this check at "
            "your own risk (train.start_check=false)"
        )
    return check


def _options(cfg: JobConfig, dims: ParallelDims) -> tuple[VerifyOptions, torch.dtype]:
    """verify's options for this job's pattern, and the dtype its devices compute it in."""
    seq_len = verify_seq_len(dims.sp_size, VerifyOptions())
    windowed = bool(not cfg.model.builder and windowed_attention(hf_config(cfg.model), 1 << 62))
    masked = cfg.data.documents is DocumentBoundaries.masked
    options = VerifyOptions(
        dp=dims.dp_size,
        documents=DOCUMENTS if masked else 0,
        window=seq_len // 4 if windowed else 0,
        inject=Inject(os.environ.get(INJECT_ENV, Inject.none.value)),
    )
    bf16_only = dims.device.type == "cuda" and (windowed or masked or dims.ring_size > 1)
    return options, torch.bfloat16 if bf16_only else torch.float32


def _document_kernel_used(dims: ParallelDims, options: VerifyOptions) -> bool:
    """A GPU job whose attention runs the flash varlen kernel: documents or windows (the check's
    options carry the job's), or a ring (its rounds run it whatever the pattern)."""
    return dims.device.type == "cuda" and bool(
        options.window or options.documents or dims.ring_size > 1
    )


def _compared(
    model: ModelConfig, dims: ParallelDims, options: VerifyOptions, dtype: torch.dtype
) -> str:
    ring = f" (Ulysses {dims.ulysses_size} x ring {dims.ring_size})" if dims.ring_size > 1 else ""
    pattern = [f"{options.documents} packed documents"] if options.documents else []
    pattern += [f"a window of {options.window}"] if options.window else []
    name = model.pretrained_path or model.builder or model.model_type
    return (
        f"{name} shrunk to {options.layers} layers, SP {dims.sp_size}{ring} x DP {dims.dp_size} "
        f"on {dims.device.type} in {str(dtype).removeprefix('torch.')} against one device in fp32"
        + (f", {' and '.join(pattern)}" if pattern else "")
        + (f", INJECTED BUG {options.inject.value}" if options.inject is not Inject.none else "")
    )


def _outcome(
    report: Report,
    options: VerifyOptions,
    compared: str,
    seconds: float,
    kernels: list[KernelCheck],
) -> StartCheck:
    tolerance = options.tolerance
    if report.baseline_error is not None:
        tolerance = max(tolerance, FACTOR * report.baseline_error + FLOOR)
    text = format_report(report, tolerance)
    failed_kernels = [k for k in kernels if not k.passed]
    if kernels:
        text += "\n" + "\n".join(
            f"  document kernel, {k.case}: {'ok' if k.passed else 'MISMATCH'} (output "
            f"{k.output:.1e}, gradients q {k.grad_query:.1e} k {k.grad_key:.1e} v "
            f"{k.grad_value:.1e}, {k.dtype} against the CPU kernel in fp32)"
            for k in kernels
        )
    return StartCheck(
        passed=not failures(report, tolerance) and not failed_kernels,
        compared=compared,
        torch=torch.__version__,
        transformers=transformers.__version__,
        worst_error=report.worst_error,
        tolerance=tolerance,
        seconds=seconds,
        report=text,
    )


def _recorded(run: RunConfig, compared: str) -> StartCheck | None:
    """The passed check recorded in the run directory, if it compared the same thing with the
    same torch and transformers."""
    path = RunDir(run.dir).start_check
    try:
        check = StartCheck(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    same = (check.compared, check.torch, check.transformers) == (
        compared,
        torch.__version__,
        transformers.__version__,
    )
    return check if same and check.passed else None


def _record(run: RunConfig, check: StartCheck) -> None:
    """Write the outcome whole or not at all: a half-written record is never read as passed.
    A record that cannot be written costs only a repeat of the check next time."""
    path = RunDir(run.dir).start_check
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(json.dumps(asdict(check), indent=1) + "\n")
        os.replace(partial, path)
    except OSError as err:
        log.warning("could not record the exactness check in %s: %s", path, err)
