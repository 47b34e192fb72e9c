"""The exactness of the attention kernels slurm_autosp.compile owns (packed documents, sliding
windows) on this rank's device, behind one small interface: the probe runs it on every rank of
the user's nodes before the long job, the GPU check on its one GPU.

The checks themselves belong to slurm_autosp.compile (being written); this adapter expects

    slurm_autosp.compile.kernel_check.check_kernels(device: torch.device, *, tiny: bool)
        -> Sequence[result]

each result having the attributes
    name: str              what is compared, e.g. "packed documents vs each document alone"
    passed: bool | None    None: refused on this device (the reason in `detail`), not run
    error: float | None    the measured error, as the check defines it (None when refused)
    tolerance: float | None  what `error` is held to
    detail: str            how the error was measured, or why the check was refused

It runs on this rank's device alone, without torch.distributed (every rank runs it on its own,
before the collectives), in seconds at `tiny` shapes. Until it exists each expected check is
reported "missing", which is not a pass.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

PROVIDER = "slurm_autosp.compile.kernel_check"
EXPECTED = ("packed documents vs each document alone", "sliding window vs the model's own mask")
PASS, FAIL, REFUSED, MISSING = "pass", "FAIL", "refused", "missing"


@dataclass(frozen=True)
class KernelCheck:
    """One exactness check on one device: `status` is pass, FAIL, refused or missing."""

    name: str
    status: str
    error: float | None
    tolerance: float | None
    detail: str

    @property
    def exact(self) -> bool | None:
        """True when it passed, False when it failed or could not run, None when refused."""
        return None if self.status == REFUSED else self.status == PASS


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def _converted(result: Any) -> KernelCheck:
    passed = result.passed
    status = REFUSED if passed is None else PASS if passed else FAIL
    return KernelCheck(
        str(result.name),
        status,
        _number(result.error),
        _number(result.tolerance),
        str(result.detail),
    )


def check_kernels(device: torch.device, tiny: bool) -> list[KernelCheck]:
    """Every kernel check the provider makes on `device`; an error inside it fails its rows."""
    try:
        provider = importlib.import_module(PROVIDER)
    except ModuleNotFoundError as err:
        if err.name != PROVIDER:
            raise
        why = f"{PROVIDER}.check_kernels does not exist yet: not checked"
        return [KernelCheck(name, MISSING, None, None, why) for name in EXPECTED]
    try:
        return [_converted(r) for r in provider.check_kernels(device, tiny=tiny)]
    except Exception as err:  # noqa: BLE001 - a crashing check is a failed check, named
        log.exception("kernel exactness check failed on %s", device)
        return [
            KernelCheck(name, FAIL, None, None, f"{type(err).__name__}: {err}") for name in EXPECTED
        ]


_WORSE = {REFUSED: 0, PASS: 1, MISSING: 2, FAIL: 3}


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
    None: some check did not run."""
    failed = [s for s in summaries if s.status == FAIL]
    if failed:
        named = ", ".join(f"{s.name} on rank(s) {s.ranks}" for s in failed)
        return False, f"kernels exact: NO ({named})"
    missing = [s.name for s in summaries if s.status == MISSING]
    if missing or not summaries:
        return None, f"kernels: not checked ({', '.join(missing) or 'no check'}: see {PROVIDER})"
    refused = [s.name for s in summaries if s.status == REFUSED]
    return True, "kernels exact: yes" + (
        f" (refused here: {', '.join(refused)})" if refused else ""
    )
