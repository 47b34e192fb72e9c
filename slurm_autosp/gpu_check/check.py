"""The GPU check's sections and their budget shares, run on one device: what they measure and
how a run reads is the command's help (commands/gpu_check.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from slurm_autosp.gpu_check.budget import Budget
from slurm_autosp.gpu_check.rows import OUT_OF_TIME, Row, error_row, exactness_row

OUTPUT = "gpu_check.json"
BUDGET_S = 480.0  # 8 minutes: one borrowed machine's 10-minute run, with its start and copies
BANDWIDTH_BYTES = {False: 256 << 20, True: 1 << 20}  # per rank: the GPU's, the --tiny run's


def no_gpu() -> str | None:
    """Why torch sees no GPU here, with what to do; None when it sees one."""
    if torch.cuda.is_available():
        return None
    tools = [tool for tool in ("nvidia-smi", "rocm-smi") if shutil.which(tool)]
    if not tools:
        return (
            "no GPU visible: neither nvidia-smi nor rocm-smi is installed here; run this on a GPU "
            "node (e.g. srun --gpus=1 python -m slurm_autosp gpu-check), or add --device cpu --tiny --eager "
            "for the CPU self-test"
        )
    return (
        f"no GPU visible to torch: torch.cuda.is_available() is False although {tools[0]} is "
        "installed (a CPU build of torch? install a CUDA or ROCm wheel: TORCH_SPEC in install.sh)"
    )


@contextmanager
def one_rank(device: torch.device) -> Iterator[None]:
    """A process group of this process alone (NCCL or RCCL on GPU, gloo on CPU): the engine,
    the SP all-to-all and the probe's steps run over it as over a job's."""
    import torch.distributed as dist

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{tmp}/store",
            rank=0,
            world_size=1,
            device_id=device if device.type == "cuda" else None,
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


class Sections:
    """Runs the check's sections one by one, in their declared order, each on its own: one that
    raises becomes a failed row naming the error, and the sections after it still run. The rows
    so far are written after every section (`save`), so a run killed at a time limit leaves what
    it measured.

    Each section's `Budget` is the time left divided equally among the sections still to run,
    not a share declared with it: no section's time on a GPU has been measured to declare, and
    an equal share of what is left passes what a short section (the kernels: seconds) leaves on
    to the ones after it, while one that overruns (a unit of work is never cut short) takes
    only from those after it. A section with no time left is one failed row, not run."""

    def __init__(
        self,
        budget_s: float,
        names: Sequence[str],
        save: Callable[[list[Row]], None],
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.budget_s = budget_s
        self._clock = clock
        self.deadline = clock() + budget_s
        self._left = list(names)
        self.done: list[Row] = []
        self._save = save

    def run(self, name: str, rows_of: Callable[[Budget], list[Row]]) -> list[Row]:
        if self._left[:1] != [name]:
            expected = f"the next is {self._left[0]!r}" if self._left else "all have run"
            raise ValueError(
                f"section {name!r} run out of the order declared to Sections ({expected})"
            )
        start = self._clock()
        share = (self.deadline - start) / len(self._left)
        self._left.pop(0)
        if share <= 0:
            rows = [self._not_run(name)]
        else:
            try:
                rows = rows_of(Budget(share, start + share, self._clock))
            except Exception as error:  # noqa: BLE001 - recorded in the table, never lost
                rows = [error_row(name, error)]
        print(
            f"gpu_check: {name}: {len(rows)} rows, {self._clock() - start:.0f} s of its "
            f"{max(share, 0):.0f} s",
            flush=True,
        )
        self.done += rows
        self._save(self.done)
        return rows

    def _not_run(self, name: str) -> Row:
        return Row(
            "section",
            name,
            f"within --budget-s {self.budget_s:g}",
            "not run: the budget was spent",
            OUT_OF_TIME,
            True,
        )


def section_names() -> tuple[str, ...]:
    """run_check's sections, in its order: declared up front, so that each gets its share."""
    from slurm_autosp.gpu_check.measure import POLICIES  # after the GPU check, as run_check

    return ("bandwidth", "kernels", "rewrites", *POLICIES)


def versions() -> str:
    """What the check runs on, for its first line: torch, and CUDA (or ROCm) and NCCL (or
    RCCL) as torch was built with them."""
    parts = [f"torch {torch.__version__}"]
    if torch.version.hip:
        parts.append(f"ROCm {torch.version.hip}")
    elif torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        parts.append(f"{'RCCL' if torch.version.hip else 'NCCL'} {'.'.join(map(str, nccl))}")
    return ", ".join(parts)


def allocator_in_use(device: torch.device) -> str:
    """Whether the GPU's allocator grows its segments in place, as the memory plan's margin
    for fragmentation assumes (a segment of the allocator's own snapshot says)."""
    if device.type != "cuda":
        return "allocator: the host's"
    probe = torch.empty(1, device=device)
    segments = torch.cuda.memory._snapshot(device)["segments"]
    del probe
    if any(segment.get("is_expandable") for segment in segments):
        return "allocator: expandable segments"
    setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    return (
        f"allocator: NOT expandable segments (PYTORCH_CUDA_ALLOC_CONF={setting or 'unset'}): "
        "peaks measured here hold fragmentation the plan does not count"
    )


def run_check(
    device: torch.device, tiny: bool, eager: bool, out: Path, sections: Sections
) -> list[Row]:
    """Every row, in the table's order (the bandwidth is measured first: its processes start
    before this one holds any GPU memory)."""
    # After the GPU check: a machine without a GPU is refused in a second, not after these.
    from slurm_autosp.cluster.compile_cache import use_private_compile_cache
    from slurm_autosp.cluster.parallel_dims import build_parallel_dims
    from slurm_autosp.gpu_check.bandwidth import bandwidth_rows
    from slurm_autosp.gpu_check.exactness import check_rewrites
    from slurm_autosp.gpu_check.measure import (
        GPU_SCALE,
        POLICIES,
        TINY_SCALE,
        Target,
        check_config,
        policy_rows,
        predictions,
    )
    from slurm_autosp.memory_plan.terms import GB
    from slurm_autosp.probe.kernels import check_kernels
    from slurm_autosp.sp import set_sp_group

    on_gpu = device.type == "cuda"
    scale = TINY_SCALE if tiny else GPU_SCALE
    use_private_compile_cache(None)
    bandwidth = sections.run(
        "bandwidth",
        lambda _: bandwidth_rows(
            torch.cuda.device_count() if on_gpu else 2, on_gpu, BANDWIDTH_BYTES[tiny]
        ),
    )
    target = Target(
        device,
        ("amd" if torch.version.hip else "nvidia") if on_gpu else "none",
        torch.cuda.get_device_properties(device).total_memory / GB if on_gpu else 0.0,
        compiled=not eager,
        out=out,
    )
    rows: list[Row] = []
    with one_rank(device):
        cfg = check_config(scale, target, next(iter(POLICIES)), scale.lengths[0])
        dims = build_parallel_dims(cfg, local_rank=0, device=device)
        planned = predictions(scale, target)  # before anything compiles: it resets Dynamo
        set_sp_group(dims.sp_group)
        rows += sections.run("kernels", lambda _: [exactness_row(c) for c in check_kernels(device)])
        rows += sections.run(
            "rewrites",
            lambda _: [exactness_row(c) for c in check_rewrites(device, tiny, compiled=not eager)],
        )
        torch.compiler.reset()  # the checks' small models' graphs: no part of the policies' limits
        for policy in POLICIES:
            rows += sections.run(policy, partial(policy_rows, scale, target, policy, dims, planned))
    return rows + bandwidth
