"""A run's TensorBoard data in the terminal, for people without a browser:

    python -m slurm_autosp summary runs/tiny_cpu [--rows 20]

prints the last loss and throughput, a per-step table (loss, tokens/s, step time, peak memory
min / mean / max over ranks and the worst rank) and every memory trace: each traced rank's
peak, where in the step it happened, every rank's peak at that step, and the trace's image.
It reads the events with TensorBoard, of the `view` extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from slurm_autosp.commands.arguments import REFUSED
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.metrics.rank_memory import MemoryTrace

MIB = 2**20


def load_scalars(events_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}; TensorBoard's own reader, so purged (resumed) steps are dropped."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(events_dir), size_guidance={SCALARS: 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()[SCALARS]}


def load_traces(run_dir: Path) -> list[dict]:
    traces = sorted(RunDir(run_dir).memory_traces.glob("step_*.json"))
    return [json.loads(p.read_text()) for p in traces]


def summarize(run_dir: Path, rows: int = 20) -> str:
    scalars = load_scalars(RunDir(run_dir).tensorboard)
    loss = scalars.get("train/loss", {})
    if not loss:
        return f"{run_dir}: no training steps logged yet"
    steps = sorted(loss)
    last = steps[-1]
    measure = "allocated" if "memory/peak_allocated_mib/max" in scalars else "rss"
    mem = f"memory/peak_{measure}_mib"

    def at(tag: str, step: int) -> float | None:
        return scalars.get(tag, {}).get(step)

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    mfu = at("throughput/mfu_pct", last)
    out = [
        f"run {run_dir}: steps {steps[0]}-{last} logged",
        f"last step {last}: loss {loss[last]:.4f} | {fmt(at('throughput/tokens_per_s', last), ',.0f')} tok/s "
        f"({fmt(at('throughput/tokens_per_s_per_device', last), ',.0f')} per device) | "
        f"{fmt(at('throughput/tflops_per_device', last), '.3g')} TFLOP/s per device | "
        + (
            f"MFU {mfu:.1f}%"
            if mfu is not None
            else "MFU n/a (no peak FLOP/s: CPU, or set trace.peak_tflops_per_gpu)"
        )
        + f" | {fmt(at('time/step_s', last), '.3f')} s/step (data {fmt(at('time/data_wait_s', last), '.3f')}, "
        f"forward+backward {fmt(at('time/forward_backward_s', last), '.3f')}, optimizer {fmt(at('time/optimizer_s', last), '.3f')})",
        "",
        f"per step (peak memory: {'allocated' if measure == 'allocated' else 'resident set'}, MiB, over ranks)",
        f"{'step':>8} {'loss':>8} {'tok/s':>10} {'s/step':>8} {'min':>9} {'mean':>9} {'max':>9} {'worst rank':>10}",
    ]
    for step in _spread(steps, rows):
        out.append(
            f"{step:>8} {loss[step]:>8.4f} {fmt(at('throughput/tokens_per_s', step), ',.0f'):>10} "
            f"{fmt(at('time/step_s', step), '.3f'):>8} {fmt(at(mem + '/min', step), '.1f'):>9} "
            f"{fmt(at(mem + '/mean', step), '.1f'):>9} {fmt(at(mem + '/max', step), '.1f'):>9} "
            f"{fmt(at('memory/worst_rank', step), '.0f'):>10}"
        )
    evals = scalars.get("eval/loss", {})
    if evals:
        out += ["", "held-out evaluation", f"{'step':>8} {'loss':>8} {'perplexity':>11}"]
        for step in _spread(sorted(evals), rows):
            perplexity = fmt(at("eval/perplexity", step), ".2f")
            out.append(f"{step:>8} {evals[step]:>8.4f} {perplexity:>11}")
    traces = load_traces(run_dir)
    out += [
        "",
        f"memory traces ({RunDir(run_dir).memory_traces})"
        if traces
        else "no memory traces (trace.memory_steps)",
    ]
    for sidecar in traces:
        step = sidecar["step"]
        for data in sidecar["traces"]:
            roles = ", ".join(data.pop("roles", []))
            trace = MemoryTrace.from_dict(data)
            name = f"step_{step:08d}_rank{trace.rank}.png"
            image = (
                f"image {name}"
                if (RunDir(run_dir).memory_traces / name).exists()
                else "no image (matplotlib was not installed where it ran)"
            )
            out.append(
                f"  step {step} rank {trace.rank} ({roles}): peak {trace.peak_bytes / MIB:.1f} MiB {trace.where_peak()}; {image}"
            )
        peaks = sorted(
            ((int(r), b) for r, b in sidecar["peak_bytes_by_rank"].items()), key=lambda rb: -rb[1]
        )
        shown = ", ".join(f"rank {r} {b / MIB:.1f}" for r, b in peaks[:16])
        more = f" (+{len(peaks) - 16} lower)" if len(peaks) > 16 else ""
        out.append(f"  step {step} peak MiB by rank, highest first: {shown}{more}")
    snapshots = sorted(p.name for p in RunDir(run_dir).memory_traces.glob("*.pickle"))
    if snapshots:
        out.append(
            "  PyTorch memory snapshots (open in https://pytorch.org/memory_viz): "
            + ", ".join(snapshots)
        )
    return "\n".join(out)


def _spread(steps: list[int], rows: int) -> list[int]:
    """At most `rows` steps, evenly spread, always the first and the last."""
    if len(steps) <= rows:
        return steps
    picked = {steps[round(i * (len(steps) - 1) / (rows - 1))] for i in range(rows)}
    return sorted(picked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slurm_autosp summary", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("run_dir", type=Path, help="the run directory, <output_root>/<run name>")
    parser.add_argument("--rows", type=int, default=20, help="most steps in the per-step table")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("tensorboard") is None:
        print(
            "error: python -m slurm_autosp summary reads the events with TensorBoard, which is "
            "not installed: pip install 'slurm_autosp[view]'",
            file=sys.stderr,
        )
        return REFUSED
    run_dir = args.run_dir.resolve()
    if RunDir(run_dir.parent).tensorboard == run_dir:  # its TensorBoard folder given instead
        run_dir = run_dir.parent
    if not list(RunDir(run_dir).tensorboard.glob("events.out.tfevents.*")):
        print(
            f"error: no TensorBoard events in {RunDir(run_dir).tensorboard}: give a run directory "
            "(<output_root>/<run name>) of a run with trace.tensorboard=true",
            file=sys.stderr,
        )
        return REFUSED
    print(summarize(run_dir, max(args.rows, 2)))
    return 0
