"""What a user sees in a real TensorBoard pointed at a run directory, read over its HTTP API.

The run is tests/resubmitted_run.py's: 6 steps of the shipped tiny_cpu config, its last
checkpoint invalidated, and submitted again for 8 steps: it resumes from step 3, so steps 4-6
and the step-5 trace are logged twice and TensorBoard must show each once.
"""

import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two training runs and a TensorBoard server
REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


@pytest.fixture(scope="module")
def run_dir(resubmitted_run):
    assert "at step 3" in resubmitted_run.resumed.stdout, resubmitted_run.resumed.stdout[-3000:]
    return resubmitted_run.run_dir


class TensorBoard:
    def __init__(self, url):
        self.url = url

    def get(self, route, **params):
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{route}{query}", timeout=30) as response:
            return response.read()

    def json(self, route, **params):
        return json.loads(self.get(route, **params))


@pytest.fixture(scope="module")
def tensorboard(run_dir, tmp_path_factory):
    """`tensorboard --logdir <run_dir>` with its default loader, on a localhost port the OS picks
    (--port 0: no free-port race); the URL comes from its start-up line."""
    log_path = tmp_path_factory.mktemp("tensorboard") / "log"
    log = log_path.open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(run_dir),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # up, and done loading the images of the last trace
            assert server.poll() is None, f"tensorboard exited with {server.returncode}"
            serving = re.search(
                r"TensorBoard \S+ at (http://127\.0\.0\.1:\d+)/", log_path.read_text()
            )
            if serving:
                board = TensorBoard(serving.group(1))
                try:
                    images = board.json(
                        "/data/plugin/images/images", run="tensorboard", tag="memory_trace/rank_0"
                    )
                    if [i["step"] for i in images] == [2, 5]:
                        break
                except OSError:
                    pass
            assert time.monotonic() < deadline, "tensorboard did not serve the run within 120 s"
            time.sleep(0.5)
        yield board
    finally:  # it has nothing to save, and takes its time to stop when asked
        server.kill()
        server.wait(timeout=15)
        log.close()


def scalar_steps(tensorboard, tag):
    return [
        step
        for _, step, _ in tensorboard.json(
            "/data/plugin/scalars/scalars", run="tensorboard", tag=tag
        )
    ]


def test_tensorboard_lists_loss_throughput_and_memory_scalars(tensorboard):
    assert tensorboard.json("/data/runs") == ["tensorboard"]
    tags = set(tensorboard.json("/data/plugin/scalars/tags")["tensorboard"])
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "throughput/tokens_per_s",
        "throughput/tokens_per_s_per_device",
        "throughput/tflops_per_device",
        "time/step_s",
        "time/data_wait_s",
        "time/forward_backward_s",
        "time/optimizer_s",
        "memory/peak_rss_mib/min",
        "memory/peak_rss_mib/max",
        "memory/peak_rss_mib/mean",
        "memory/worst_rank",
    } <= tags
    assert "throughput/mfu_pct" not in tags  # CPU: no peak FLOP/s to divide by
    loss = tensorboard.json("/data/plugin/scalars/scalars", run="tensorboard", tag="train/loss")
    assert loss[-1][2] < loss[0][2]
    low, high = (
        tensorboard.json(
            "/data/plugin/scalars/scalars", run="tensorboard", tag=f"memory/peak_rss_mib/{s}"
        )
        for s in ("min", "max")
    )
    assert all(
        50 < lo[2] <= hi[2] < 64 * 1024 for lo, hi in zip(low, high, strict=True)
    )  # MiB of a 2-rank CPU run
    split = [
        tensorboard.json("/data/plugin/scalars/scalars", run="tensorboard", tag=f"time/{t}")[-1][2]
        for t in ("data_wait_s", "forward_backward_s", "optimizer_s", "step_s")
    ]
    # the split is the mean over ranks, the step rank 0's own wall time: a slower rank 1 lifts the mean a little
    assert 0 < sum(split[:3]) <= 1.1 * split[3]


def test_resumed_run_shows_every_step_once(tensorboard):
    for tag in ("train/loss", "throughput/tokens_per_s", "memory/peak_rss_mib/max", "time/step_s"):
        assert scalar_steps(tensorboard, tag) == list(range(1, 9)), tag


def test_memory_traces_are_images_with_text_in_tensorboard(tensorboard):
    images = tensorboard.json("/data/plugin/images/tags")["tensorboard"]
    assert {"memory_trace/rank_0", "memory_trace/worst_rank"} <= set(images)
    for tag in ("memory_trace/rank_0", "memory_trace/worst_rank"):
        entries = tensorboard.json("/data/plugin/images/images", run="tensorboard", tag=tag)
        assert [e["step"] for e in entries] == [2, 5]  # the re-traced step 5 once
        png = tensorboard.get("/data/plugin/images/individualImage?" + entries[-1]["query"])
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000
    texts = tensorboard.json(
        "/data/plugin/text/text", run="tensorboard", tag="memory_trace/rank_0/text_summary"
    )
    assert [t["step"] for t in texts] == [2, 5]
    assert "peak" in texts[-1]["text"] and "MiB resident (RSS)" in texts[-1]["text"]
    for phase in ("data", "forward", "backward", "optimizer"):
        assert f"<td>{phase}</td>" in texts[-1]["text"]


def test_run_text_holds_config_layout_environment_and_flop_formula(tensorboard):
    tags = set(tensorboard.json("/data/plugin/text/tags")["tensorboard"])
    assert {
        "run/config/text_summary",
        "run/layout/text_summary",
        "run/environment/text_summary",
        "run/throughput_accounting/text_summary",
    } <= tags
    config = tensorboard.json(
        "/data/plugin/text/text", run="tensorboard", tag="run/config/text_summary"
    )
    assert "sp_size: 2" in config[0]["text"]
    flops = tensorboard.json(
        "/data/plugin/text/text", run="tensorboard", tag="run/throughput_accounting/text_summary"
    )
    assert "S^2" in flops[0]["text"] and "no MFU" in flops[0]["text"]


def test_memory_trace_files_sit_next_to_the_events(run_dir):
    memory = run_dir / "tensorboard" / "memory"
    sidecar = json.loads((memory / "step_00000005.json").read_text())
    assert set(sidecar["peak_bytes_by_rank"]) == {"0", "1"}
    roles = [role for trace in sidecar["traces"] for role in trace["roles"]]
    assert sorted(roles) == ["rank_0", "worst_rank"]
    assert (memory / "step_00000005_rank0.png").read_bytes().startswith(b"\x89PNG")


def test_terminal_summary_shows_last_loss_throughput_and_peaks(run_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_autosp", "summary", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "steps 1-8 logged" in out and "last step 8: loss " in out and "tok/s" in out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(1, 9))
    assert "step 5 rank 0 (rank_0" in out and "peak MiB by rank, highest first: rank" in out
