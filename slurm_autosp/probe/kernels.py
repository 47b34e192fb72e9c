"""The exactness of the attention kernels slurm_autosp.compile owns (packed documents, sliding
windows) on this rank's device: the probe runs it on every rank of the user's nodes before the
long job, the GPU check on its one GPU. It runs on the rank's device alone, without
torch.distributed (every rank runs it before the collectives), in seconds: two rows of 256
tokens (sp/kernel_check.py). On ROCm the kernel is refused (jobs are refused at submit),
so its checks are reported refused, not run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from slurm_autosp.sp.kernel_check import (
    CASES,
    GRADIENT_BOUND,
    OUTPUT_BOUND,
    check_document_kernel,
)

log = logging.getLogger(__name__)

PASS, FAIL, REFUSED = "pass", "FAIL", "refused"


@dataclass(frozen=True)
class KernelCheck:
    """One exactness check on one device: `status` is pass, FAIL or refused."""

    name: str
    status: str
    error: float | None
    tolerance: float | None
    detail: str

    @property
    def exact(self) -> bool | None:
        """True when it passed, False when it failed, None when refused."""
        return None if self.status == REFUSED else self.status == PASS


def check_kernels(device: torch.device) -> list[KernelCheck]:
    """Every document-attention case on `device` in bf16 against the CPU kernel in fp32; a
    check that raises fails its rows, named."""
    if device.type == "cuda" and torch.version.hip:
        why = "the flash varlen kernel has not been tested on ROCm: jobs using it are refused at submit"
        return [KernelCheck(case, REFUSED, None, None, why) for case in CASES]
    try:
        results = check_document_kernel(device, torch.bfloat16)
    except Exception as err:  # noqa: BLE001 - a crashing check is a failed check, named
        log.exception("kernel exactness check failed on %s", device)
        return [
            KernelCheck(case, FAIL, None, None, f"{type(err).__name__}: {err}") for case in CASES
        ]
    checks = []
    for r in results:
        gradient = max(r.grad_query, r.grad_key, r.grad_value)
        output_worse = r.output / OUTPUT_BOUND >= gradient / GRADIENT_BOUND
        checks.append(
            KernelCheck(
                r.case,
                PASS if r.passed else FAIL,
                r.output if output_worse else gradient,
                OUTPUT_BOUND if output_worse else GRADIENT_BOUND,
                f"{r.dtype} on {r.device} vs the CPU kernel in fp32: output {r.output:.1e}, "
                f"gradients q {r.grad_query:.1e} k {r.grad_key:.1e} v {r.grad_value:.1e}",
            )
        )
    return checks


_WORSE = {REFUSED: 0, PASS: 1, FAIL: 2}


@dataclass(frozen=True)
class KernelSummary:
    """One check over every rank: its worst status, the ranks with it, the largest error."""

    name: str
    status: str
    ranks: list[int]  # the ranks whose status is `status`
    error: float | None
    tolerance: float | None
    detail: str  # the first of those ranks'


def summarise(by_rank: dict[int, list[KernelCheck]]) -> list[KernelSummary]:
    names = list(dict.fromkeys(c.name for checks in by_rank.values() for c in checks))
    summaries = []
    for name in names:
        checks = {r: c for r, cs in by_rank.items() for c in cs if c.name == name}
        worst = max(checks.values(), key=lambda c: _WORSE[c.status])
        errors = [c.error for c in checks.values() if c.error is not None]
        summaries.append(
            KernelSummary(
                name,
                worst.status,
                sorted(r for r, c in checks.items() if c.status == worst.status),
                max(errors) if errors else None,
                worst.tolerance,
                worst.detail,
            )
        )
    return summaries


def kernels_verdict(summaries: list[KernelSummary]) -> tuple[bool | None, str]:
    """Exact (every check passed, or was refused), not exact (one failed on some rank), or
    None: no check ran."""
    failed = [s for s in summaries if s.status == FAIL]
    if failed:
        named = ", ".join(f"{s.name} on rank(s) {s.ranks}" for s in failed)
        return False, f"kernels exact: NO ({named})"
    if not summaries:
        return None, "kernels: not checked"
    refused = [s.name for s in summaries if s.status == REFUSED]
    return True, "kernels exact: yes" + (
        f" (refused here: {', '.join(refused)})" if refused else ""
    )
