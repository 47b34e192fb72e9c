"""python -m slurm_autosp gpu-check [--out DIR] [--device cuda|cpu] [--tiny] [--eager]

The first GPU evidence in one command: one process on one GPU,
at SP=1, prints one table and writes it to DIR/gpu_check.json (default runs/gpu_check):

- exactness (correctness rows): the attention kernels of slurm_autosp.compile (packed
  documents, sliding windows: probe/kernels.py) and the memory-saving rewrites (tiled vs
  untiled MLPs and layers, offloaded vs resident activations: gpu_check/exactness.py), in bf16
  against an fp32 reference;
- plan vs peak: the memory plan against the measured peak, per checkpointing policy (none, sac
  at budget 0, full) at 32k and 128k tokens, 4 decoder layers of Llama-3.1-8B width (goal: ±10%);
- step: step time, tokens/s and MFU at the same lengths;
- longest: per policy, the longest sequence that fits, searched by memory through the same
  compiled model (gpu_check/search.py), within the policy's share of the budget;
- bandwidth: all-reduce and all-to-all across the GPUs, where more than one is visible.

A section that raises is one failed row naming the error; the sections after it still run and
the report is still written, as it is after every section (a run killed at a time limit leaves
what it measured). --budget-s is shared out so that one slow section cannot take every later
one's time: each section gets the time left divided equally among those still to run, and asks
it between units of work (a kernel cannot be stopped safely midway): a length it did not reach,
or a search it stopped, is an "out of time" row beside what it measured; a section with no time
left is one failed "out of time" row. Exit status 0 only when every section ran and every
correctness row passed (a row the device refuses, e.g. a kernel ROCm lacks, is named as refused
and does not fail it); 1 otherwise; 2 without a GPU. The output of an earlier run is removed
first, so a failed run never leaves old results to read.

  --device cpu --tiny --eager: every row's code on CPU, tiny shapes, uncompiled (a self-test
  of this command, not evidence about any kernel); --tiny alone compiles them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import torch

from slurm_autosp.cluster.comm_env import allocator_env
from slurm_autosp.commands.arguments import REFUSED
from slurm_autosp.gpu_check.check import (
    BUDGET_S,
    OUTPUT,
    Sections,
    allocator_in_use,
    no_gpu,
    run_check,
    section_names,
    versions,
)
from slurm_autosp.gpu_check.rows import Row, error_row, render


def _write(path: Path, report: dict) -> None:
    """Whole or not at all: a reader never sees half a report."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=1))
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slurm_autosp gpu-check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="runs/gpu_check", help="where gpu_check.json goes")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU self-test)")
    parser.add_argument("--eager", action="store_true", help="uncompiled (the CPU self-test)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help="seconds for the whole check, each section given the time left divided equally "
        "among those still to run; what a section does not reach within its share is an "
        "'out of time' row",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / OUTPUT).unlink(missing_ok=True)
    refusal = no_gpu() if args.device == "cuda" else None
    if refusal:
        print(f"gpu_check: {refusal}", file=sys.stderr)
        return REFUSED
    if args.device == "cuda" and not torch.version.hip:  # before CUDA starts: as a job runs
        os.environ.update(allocator_env(os.environ))
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if args.device == "cuda" else "CPU"
    started, start = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    found = versions()
    allocator = allocator_in_use(device)
    print(f"gpu_check: {name}, {found}, {allocator}; output in {out / OUTPUT}", flush=True)

    def report(rows: list[Row], complete: bool) -> dict:
        return {
            "run_id": run_id,
            "started": started.isoformat(timespec="seconds"),
            "seconds": time.perf_counter() - start,
            "device": name,
            "torch": torch.__version__,
            "versions": found,
            "allocator": allocator,
            "rocm": torch.version.hip,
            "tiny": args.tiny,
            "eager": args.eager,
            "complete": complete,
            "passed": complete and not any(r.failed for r in rows),
            "rows": [asdict(r) for r in rows],
        }

    run_id = uuid.uuid4().hex
    sections = Sections(
        args.budget_s, section_names(), lambda rows: _write(out / OUTPUT, report(rows, False))
    )
    try:
        rows = run_check(device, args.tiny, args.eager, out, sections)
    except Exception as error:  # noqa: BLE001 - outside any section: the report still says why
        rows = [*sections.done, error_row("setup", error)]
    failed = [r for r in rows if r.failed]
    print(render(rows))
    print(
        f"gpu_check: {'FAILED: ' + ', '.join(r.case for r in failed) if failed else 'every correctness row passed'}"
        f" ({time.perf_counter() - start:.0f} s)"
    )
    _write(out / OUTPUT, report(rows, True))
    return 1 if failed else 0
