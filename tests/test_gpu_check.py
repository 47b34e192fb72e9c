"""python -m slurm_autosp gpu-check: fails fast where no GPU is
visible, never leaves an earlier run's output to be read, and in its CPU self-test (tiny shapes,
eager) runs every row's code; its parts: the kernel checks' adapter, the rewrites' exactness
check (which must catch a broken rewrite), the search for the longest sequence, and the budget
each section gets of the check's time."""

import itertools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import oom_model
import pytest
import torch
import yaml
from in_process import run_command

from slurm_autosp.compile import tiling
from slurm_autosp.config import JobConfig
from slurm_autosp.gpu_check.budget import Budget
from slurm_autosp.gpu_check.check import OUTPUT, Sections, one_rank
from slurm_autosp.gpu_check.exactness import TINY_SHAPE, check_rewrites
from slurm_autosp.gpu_check.measure import (
    GPU_SCALE,
    TINY_SCALE,
    Scale,
    Target,
    check_config,
    longest_row,
    plan_row,
    policy_rows,
    step_row,
)
from slurm_autosp.gpu_check.rows import OUT_OF_TIME, Row
from slurm_autosp.gpu_check.search import longest_fitting
from slurm_autosp.memory_plan import build_plan, plan_verdict, training_choices
from slurm_autosp.memory_plan.terms import GB
from slurm_autosp.probe import kernels
from slurm_autosp.probe.prediction import PlanPrediction, predict_memory
from slurm_autosp.probe.steps import OutOfMemory, StepMeasurement
from slurm_autosp.sp.kernel_check import CASES

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
UNLIMITED = Budget(math.inf, math.inf)


@pytest.mark.slow
def test_the_command_fails_fast_without_a_gpu_and_leaves_no_earlier_output(tmp_path):
    """A rerun that fails must not leave the last run's table to be read as its own."""
    earlier = tmp_path / OUTPUT
    earlier.write_text('{"passed": true}')
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_autosp", "gpu-check", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("gpu_check: no GPU visible"), proc.stderr
    assert "--device cpu --tiny --eager" in proc.stderr
    assert not earlier.exists()


@pytest.mark.slow
def test_the_cpu_self_test_runs_every_row_and_its_exit_status_is_the_correctness_rows(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_autosp", "gpu-check", "--device", "cpu", "--tiny"]
        + ["--eager", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads((tmp_path / OUTPUT).read_text())
    rows = report["rows"]
    by_check = {}
    for row in rows:
        by_check.setdefault(row["check"], []).append(row)
    assert [len(by_check[c]) for c in ("plan vs peak", "step", "longest", "bandwidth")] == [
        6,
        6,
        3,
        2,
    ], proc.stdout
    rewrites = {r["case"]: r["result"] for r in by_check["exactness"] if r["case"] in REWRITES}
    assert rewrites == dict.fromkeys(REWRITES, "pass"), proc.stdout
    assert all(r["correctness"] for r in by_check["exactness"])
    failed = [r for r in rows if r["correctness"] and r["result"] not in ("pass", "refused")]
    assert proc.returncode == (1 if failed else 0) and report["passed"] is not failed
    assert all(r["check"] in proc.stdout and r["case"] in proc.stdout for r in rows)


REWRITES = (
    "tiled MLPs vs untiled",
    "tiled layers vs untiled (full)",
    "offloaded vs resident activations",
)


def test_the_exactness_check_catches_a_tile_left_out(monkeypatch):
    """The last (short) tile of every tiled MLP left out, its output zero (skipping it outright
    would leave uninitialized memory, whose error is chance): the tiled row fails, the others
    still pass."""
    honest = tiling._untiled

    def last_tile_left_out(mlp, x):
        out = honest(mlp, x)
        return out * 0 if x.shape[1] < TINY_SHAPE.tile_tokens else out

    monkeypatch.setattr(tiling, "_untiled", last_tile_left_out)
    with one_rank(CPU):  # the step counts its labels over its world, as in the check
        results = {c.name: c.status for c in check_rewrites(CPU, tiny=True, compiled=False)}
    assert results == {
        "tiled MLPs vs untiled": "FAIL",
        "tiled layers vs untiled (full)": "pass",
        "offloaded vs resident activations": "pass",
    }


def test_the_kernel_checks_run_compiles_document_kernel_on_this_device():
    """On CPU the op's own kernel in bf16 against itself in fp32: every case passes, its error
    held to the bound it is nearest."""
    checks = kernels.check_kernels(CPU)
    assert [c.name for c in checks] == list(CASES)
    assert all(c.status == "pass" and 0 < c.error <= c.tolerance for c in checks), checks
    assert "vs the CPU kernel in fp32" in checks[0].detail


def test_a_kernel_check_that_raises_fails_every_row(monkeypatch):
    """(A kernel that errs fails its case: tests/compile/test_document_kernel.py.)"""

    def crashes(*args, **kwargs):
        raise RuntimeError("no varlen kernel for this device")

    monkeypatch.setattr(kernels, "check_document_kernel", crashes)
    checks = kernels.check_kernels(CPU)
    assert [c.status for c in checks] == ["FAIL"] * len(CASES)
    assert checks[0].detail == "RuntimeError: no varlen kernel for this device"


def test_on_rocm_the_kernel_checks_are_refused_not_run(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    checks = kernels.check_kernels(torch.device("cuda"))
    assert {c.status for c in checks} == {"refused"} and "ROCm" in checks[0].detail


def _memory_of(capacity):
    """A device that runs every length up to `capacity` tokens, recording each try."""
    tried = []

    def fits(length):
        tried.append(length)
        return length <= capacity

    return fits, tried


def _search(fits, known_fit, known_oom, *, ceiling=1 << 20, budget=UNLIMITED):
    """The GPU's search: multiples of 8,192, to 12.5%."""
    return longest_fitting(
        fits, known_fit, known_oom, granule=8192, ceiling=ceiling, resolution=0.125, budget=budget
    )


def test_the_search_doubles_to_the_first_oom_then_halves_the_gap_to_the_resolution():
    fits, tried = _memory_of(300_000)
    found = _search(fits, 131072, None)
    assert tried == [262144, 524288, 393216, 327680, 294912]
    assert (found.longest, found.first_oom) == (294912, 327680)
    assert found.first_oom - found.longest <= 0.125 * found.longest


def test_the_search_halves_when_even_the_known_lengths_run_out_of_memory():
    fits, tried = _memory_of(20_000)
    found = _search(fits, None, 32768)
    assert tried == [16384, 24576] and (found.longest, found.first_oom) == (16384, 24576)
    fits, tried = _memory_of(1000)
    nothing = _search(fits, None, 32768)
    assert tried == [16384, 8192] and nothing.longest is None
    assert nothing.describe() == "nothing fits: 8,192 tokens ran out of memory"


def test_the_search_stops_at_its_ceiling():
    fits, tried = _memory_of(10**9)
    found = _search(fits, 131072, None, ceiling=393216)
    assert tried == [262144, 393216] and found.first_oom is None
    assert "the ceiling" in found.describe()


def _quadratic_clock(tried: list[int]):
    """A try takes (length / 262,144)^2 seconds, as attention's share of a step grows."""
    return lambda: sum((n / 262144) ** 2 for n in tried)


def test_the_search_stops_before_a_try_once_its_budget_is_spent_and_reports_what_it_found():
    """A budget spent by two tries (1 s, then 4 s) stops the search before its third, its row
    out of time with the lower bound found so far."""
    fits, tried = _memory_of(300_000)
    found = _search(fits, 131072, None, budget=Budget(12.0, 5.0, clock=_quadratic_clock(tried)))
    assert tried == [262144, 524288]
    row = longest_row("none", found, GPU_SCALE)
    assert (row.measured, row.result, row.correctness) == (
        "longest >= 262,144 tokens, 524,288 ran out of memory; "
        "search stopped at its budget of 12.0 s",
        OUT_OF_TIME,
        False,
    )
    fits, tried = _memory_of(1000)
    nothing = _search(fits, None, 32768, budget=Budget(3.0, 1.0, clock=lambda: len(tried)))
    assert tried == [16384] and nothing.describe() == (
        "none found to fit yet, 16,384 ran out of memory; search stopped at its budget of 3.0 s"
    )


def test_the_search_does_not_start_a_try_that_would_overrun_its_budget():
    """After 1 s at 262,144 tokens, 524,288 would take about 4 s: with 2 s left it is not
    started, and the row says why."""
    fits, tried = _memory_of(300_000)
    found = _search(fits, 131072, None, budget=Budget(12.0, 3.0, clock=_quadratic_clock(tried)))
    assert tried == [262144] and found.describe() == (
        "longest >= 262,144 tokens; search stopped at its budget of 12.0 s "
        "(524,288 tokens would take about 4 s, 2 s were left)"
    )


def test_each_section_gets_the_time_left_shared_equally_and_one_past_it_is_not_run():
    """60 s for four sections on a clock the sections move: the first's 5 s leave 55 s over
    three; the second overruns its 18.3 s to 40 s, which only those after it pay for (the third
    gets 7.5 s of the 15 left); the fourth, with nothing left, is one failed row. The rows so far
    are saved after every section."""
    now = [0.0]
    shares: list[float] = []
    saved: list[int] = []

    def taking(seconds):
        def rows_of(budget):
            shares.append(budget.seconds)
            now[0] += seconds
            assert budget.spent() is (seconds >= budget.seconds)
            return [Row("step", "measured", "-", f"{seconds} s", "measured")]

        return rows_of

    sections = Sections(60, "abcd", lambda rows: saved.append(len(rows)), clock=lambda: now[0])
    for name, seconds in zip("abcd", (5, 40, 20, 1), strict=True):
        sections.run(name, taking(seconds))
    assert shares == pytest.approx([15, 55 / 3, 7.5])
    assert saved == [1, 2, 3, 4]
    assert sections.done[-1] == Row(
        "section", "d", "within --budget-s 60", "not run: the budget was spent", OUT_OF_TIME, True
    )
    assert sections.done[-1].failed
    with pytest.raises(
        ValueError, match=r"section 'a' run out of the order declared to Sections \(all have run\)"
    ):
        sections.run("a", taking(0))


def _forget_deepspeeds_world():
    """DeepSpeed forgets the world group an earlier test's engine cached (its group destroyed
    since), as a new process would never have seen it."""
    from deepspeed.utils import groups

    groups._WORLD_GROUP = None


@pytest.fixture()
def cpu_rank():
    """This process as a one-rank job (gloo); the environment it sets is put back after."""
    _forget_deepspeeds_world()
    saved = dict(os.environ)
    try:
        with one_rank(CPU):
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_a_policys_rows_search_on_through_out_of_memory_errors(tmp_path, cpu_rank):
    """A model that runs out of memory above 700 tokens (oom_model.build_short, the stand-in for
    the GPU's memory): both lengths fit, the search doubles to 1,024, runs out, and goes on
    through a rebuilt engine to 640 fitting and 704 not."""
    from slurm_autosp.cluster.parallel_dims import build_parallel_dims

    shipped = yaml.safe_load((REPO / TINY_SCALE.config).read_text())
    shipped["model"]["builder"] = "oom_model:build_short"
    config = tmp_path / "short.yaml"
    config.write_text(yaml.safe_dump(shipped))
    scale = Scale(str(config), 2, (256, 512), 2, 64, 1024, 0.125)
    target = Target(CPU, "none", 0.0, compiled=False, out=tmp_path)
    cfg = check_config(scale, target, "none", 256)
    assert cfg.model.builder == "oom_model:build_short"
    dims = build_parallel_dims(cfg, local_rank=0, device=CPU)
    rows = policy_rows(
        scale, target, "none", dims, {("none", 256): None, ("none", 512): None}, UNLIMITED
    )
    longest = rows[-1]
    assert 640 <= oom_model.SHORT_FIT < 704
    assert longest.measured == "640 tokens fit, 704 ran out of memory", longest
    assert longest.detail == "tries: 1,024 OOM, 768 OOM, 640 fits, 704 OOM"
    assert [r.result for r in rows[:-1]] == ["-", "measured", "-", "measured"]


def test_a_policy_past_its_budget_keeps_what_it_measured_and_records_the_rest_out_of_time(
    tmp_path, cpu_rank
):
    """The budget is asked before each length and each try (the clock counts the asks): spent
    after the first length, the second length's rows and the search are out of time, the first
    length's rows measured. Spent before the first, every row is out of time, nothing searched."""
    from slurm_autosp.cluster.parallel_dims import build_parallel_dims

    target = Target(CPU, "none", 0.0, compiled=False, out=tmp_path)
    dims = build_parallel_dims(
        check_config(TINY_SCALE, target, "none", 256), local_rank=0, device=CPU
    )
    planned = {("none", 256): None, ("none", 512): None}
    asks = itertools.count()
    budget = Budget(30.0, 1.0, clock=lambda: next(asks))
    rows = policy_rows(TINY_SCALE, target, "none", dims, planned, budget)
    assert [(r.check, r.case, r.result) for r in rows] == [
        ("plan vs peak", "none @ 256", "-"),
        ("step", "none @ 256", "measured"),
        ("plan vs peak", "none @ 512", OUT_OF_TIME),
        ("step", "none @ 512", OUT_OF_TIME),
        ("longest", "none", OUT_OF_TIME),
    ]
    assert rows[2].measured == "not reached: the section's budget of 30.0 s was spent"
    assert rows[-1].measured == "longest >= 256 tokens; search stopped at its budget of 30.0 s"
    assert rows[-1].detail == "no try: the budget was spent before the first"
    assert not any(r.failed for r in rows)
    spent = policy_rows(TINY_SCALE, target, "none", dims, planned, Budget(1.0, -1.0))
    assert [(r.check, r.result) for r in spent] == [
        ("plan vs peak", OUT_OF_TIME),
        ("step", OUT_OF_TIME),
        ("plan vs peak", OUT_OF_TIME),
        ("step", OUT_OF_TIME),
        ("longest", OUT_OF_TIME),
    ]


def _measured(peak_gb: float, oom: bool = False) -> StepMeasurement:
    failure = (
        OutOfMemory(1, "CUDA out of memory.", int(peak_gb * 1e9), int(peak_gb * 1e9), 0)
        if oom
        else None
    )
    seconds = [] if oom else [9.0, 1.0, 1.0]
    return StepMeasurement(
        seconds, [], None, 0, int(peak_gb * 1e9), 0, 4e14, 989.0, "H100", failure, ""
    )


def test_the_plan_row_on_a_gpu_holds_the_peak_to_ten_percent_and_names_the_plans_fit():
    """The row's arithmetic, on the numbers a GPU would give (none is here)."""
    plan = PlanPrediction(
        "none", {}, 0.0, 1e9, subtotal=40e9, allocator_total=44e9, outside=0.9e9, fits=True
    )
    gpu = 80e9
    within = plan_row("none", 32768, _measured(42.0), plan, gpu)
    assert (within.measured, within.result, within.fits) == ("42.00 GB (+5.0%)", "within 10%", True)
    assert within.detail.endswith(
        "plan with margin 44.00 GB and 900.00 MB outside the allocator, of the GPU's 80.00 GB: fits"
    )
    assert plan_row("none", 32768, _measured(46.0), plan, gpu).result == "off by +15.0%"
    oom = plan_row("none", 131072, _measured(79.5, oom=True), plan, gpu)
    assert (oom.measured, oom.result) == (">= 79.50 GB", "ran out of memory")
    assert "of the GPU's 80.00 GB: fits; out of memory at step 1" in oom.detail
    assert plan_row("none", 32768, _measured(0.5), plan, gpu_bytes=0.0).fits is None  # CPU
    step = step_row("none", 32768, _measured(42.0), world=1)
    assert step.measured == "1.000 s, 32,768 tokens/s, 400 TFLOP/s, MFU 40.4%"


def test_gpu_checks_json_fits_equals_the_plans_verdict_for_the_same_configuration(tmp_path):
    """The policy `none` at 32,768 tokens on a GPU whose memory lies between what the plan's
    allocator reserves and that plus the memory outside the allocator (the CUDA context, NCCL's
    buffers): submit refuses the job, and the GPU check's row says the same, in its JSON and
    its table. A plan for a GPU of that size stands in for the GPU (none is here)."""

    def on_a_gpu_of(memory_gb: float) -> JobConfig:
        target = Target(torch.device("cuda"), "nvidia", memory_gb, compiled=True, out=tmp_path)
        return check_config(GPU_SCALE, target, "none", 32768)

    traced = build_plan(on_a_gpu_of(80.0)).configured  # its terms: the same on any GPU
    between = traced.allocator_total + sum(traced.outside.values()) / 2
    cfg = on_a_gpu_of(between / GB)
    plan = build_plan(cfg)
    assert plan.configured.allocator_total < plan.gpu_bytes < plan.configured.total
    submit = plan_verdict(cfg)
    assert not submit.fits and "the job does not fit its GPUs" in submit.reason
    row = plan_row(
        "none", 32768, _measured(40.0), predict_memory(cfg, training_choices(cfg)), plan.gpu_bytes
    )
    assert row.detail.endswith(": does not fit"), row.detail
    assert asdict(row)["fits"] is submit.fits


@pytest.mark.slow
def test_a_section_that_raises_is_a_failed_row_and_the_sections_after_it_still_run(
    tmp_path, monkeypatch
):
    """The bandwidth and the rewrites' exactness raise (injected): each is one failed row
    naming its error, the kernels' rows and a policy's rows are still measured, the report is
    written and the exit status is 1. Its first line names torch (and CUDA, NCCL where built)."""
    from slurm_autosp.gpu_check import bandwidth, exactness
    from slurm_autosp.gpu_check import measure as gpu_measure

    def broken(*args, **kwargs):
        raise RuntimeError("injected: the device fell off the bus")

    monkeypatch.setattr(bandwidth, "bandwidth_rows", broken)
    monkeypatch.setattr(exactness, "check_rewrites", broken)
    monkeypatch.setattr(gpu_measure, "POLICIES", {"none": gpu_measure.POLICIES["none"]})
    done = _run_in_process("--out", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith(f"gpu_check: CPU, torch {torch.__version__}")
    report = json.loads((tmp_path / OUTPUT).read_text())
    errors = [r for r in report["rows"] if r["result"] == "ERROR"]
    assert [(r["check"], r["case"]) for r in errors] == [
        ("section", "rewrites"),
        ("section", "bandwidth"),
    ], [(r["case"], r["measured"], r["detail"]) for r in errors]
    assert all(
        r["measured"] == "RuntimeError: injected: the device fell off the bus"
        and r["detail"]
        == f"raised in broken (test_gpu_check.py:{broken.__code__.co_firstlineno + 1})"
        and r["correctness"]
        for r in errors
    )
    checks = [r["check"] for r in report["rows"] if r["result"] != "ERROR"]
    assert checks.count("exactness") == len(CASES) and checks.count("longest") == 1, checks
    assert report["complete"] and not report["passed"]
    assert "FAILED: rewrites, bandwidth" in done.stdout


def _run_in_process(*arguments: str):
    """gpu_check's CPU self-test in this process (so a section can be broken), its environment
    put back after."""
    from slurm_autosp.commands import gpu_check

    _forget_deepspeeds_world()
    saved = dict(os.environ)
    try:
        return run_command(gpu_check.main, "--device", "cpu", "--tiny", "--eager", *arguments)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.slow
def test_a_section_that_spends_the_budget_is_kept_and_every_later_one_is_recorded_not_run(
    tmp_path, monkeypatch
):
    """The bandwidth (first) takes a second of a half-second budget: its row is kept, each later
    section is a failed 'not run' row, and the report is complete."""
    from slurm_autosp.gpu_check import bandwidth

    def slow(*args, **kwargs):
        time.sleep(1.0)
        return [Row("bandwidth", "all-reduce", "-", "1 GB/s", "measured")]

    monkeypatch.setattr(bandwidth, "bandwidth_rows", slow)
    done = _run_in_process("--out", str(tmp_path), "--budget-s", "0.5")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((tmp_path / OUTPUT).read_text())
    not_run = ("kernels", "rewrites", "none", "sac_budget_0", "full")
    assert [(r["case"], r["result"]) for r in report["rows"]] == [
        *((name, OUT_OF_TIME) for name in not_run),
        ("all-reduce", "measured"),
    ]
    assert all(
        r["expected"] == "within --budget-s 0.5"
        and r["measured"] == "not run: the budget was spent"
        for r in report["rows"][:-1]
    )
    assert report["complete"] and not report["passed"]


def test_a_run_killed_midway_leaves_the_sections_it_finished(tmp_path, monkeypatch):
    """Stopped inside its third section (an interrupt stands in for the time limit's kill):
    the report on disk holds the two sections before it, marked incomplete."""
    from slurm_autosp.gpu_check import bandwidth, exactness

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bandwidth, "bandwidth_rows", broken)
    monkeypatch.setattr(exactness, "check_rewrites", killed)
    with pytest.raises(KeyboardInterrupt):
        _run_in_process("--out", str(tmp_path))
    report = json.loads((tmp_path / OUTPUT).read_text())
    assert not report["complete"] and not report["passed"]
    sections = [r["case"] if r["check"] == "section" else r["check"] for r in report["rows"]]
    assert sections == ["bandwidth", *["exactness"] * len(CASES)], sections
