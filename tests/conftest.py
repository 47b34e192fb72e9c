"""Fixtures shared across the suite."""

import getpass
import os
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist
from packaging.version import Version
from reference_run import reference_data, train_reference
from resubmitted_run import ResubmittedRun, resubmit

REPO = Path(__file__).resolve().parents[1]
SLURM_SCRIPTS = REPO / "tests" / "slurm_cluster"


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="run every tier: also the tests marked slow and slurm, which pyproject's addopts "
        "deselect by default",
    )


def pytest_configure(config):
    if config.getoption("--full"):
        config.option.markexpr = ""  # no mark expression: nothing is deselected
    pytest_release = Version(pytest.__version__).release[:2]
    if config.getoption("dist", "no") == "loadgroup" and pytest_release >= (9, 2):
        # xdist marks a grouped test in its node id, which pytest 9.2 no longer reads: the
        # groups would be ignored, and each worker would start its own Slurm and pools
        raise pytest.UsageError(
            f"pytest {pytest.__version__} ignores pytest-xdist's test groups (--dist loadgroup), "
            "which keep the tests sharing a Slurm or a pool on one worker: install pyproject's "
            "test extra (pytest<9.2), or run the tests in one process with -n 0"
        )


# The session fixtures that cost minutes, each shared by the tests of one pytest-xdist worker.
# A test using one of them runs on the worker that holds it (the first match names the group).
_SHARED_BY_GROUP = {
    "slurm_cluster": "slurm",  # one Slurm on localhost, started once
    "uninterrupted_run": "slurm",  # the reference run that local and Slurm resumes match
    "dist_pools": "dist_pools",  # the multi-rank pools and what their ranks compiled
    "resubmitted_run": "resubmitted_run",
    "zero1_reference": "fault_matrix_zero1",
    "fsdp2_reference": "fault_matrix_fsdp2",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects and before xdist reads the groups
def pytest_collection_modifyitems(items):
    """A test that starts the local Slurm is in the slurm tier whether or not it says so, so
    the fast tier never needs Slurm. Every test gets one xdist group (`--dist loadgroup`): the
    costly session fixture it uses, else its file, whose module fixtures its tests share."""
    for item in items:
        if "slurm_cluster" in item.fixturenames and not item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.slurm)
        shared = (group for name, group in _SHARED_BY_GROUP.items() if name in item.fixturenames)
        group = next(shared, item.nodeid.split("::")[0])
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def compile_cache_dir(pytestconfig, tmp_path_factory):
    """Inductor's cache for the tests that compile in pytest's own processes: kept in pytest's
    cache directory of this checkout, so the full tier reuses what the fast tier compiled (as
    a training job reuses its node-local cache), and a fresh clone starts cold; a temporary
    one where pytest's cache is off (-p no:cacheprovider)."""
    cache = getattr(pytestconfig, "cache", None)
    return cache.mkdir("inductor") if cache else tmp_path_factory.mktemp("inductor")


@pytest.fixture(scope="session")
def reference_overrides(tmp_path_factory):
    """The data overrides of the reference run (its shuffled token file, written once)."""
    return reference_data(tmp_path_factory.mktemp("reference_data"))


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory, reference_overrides) -> Path:
    """The run directory of the uninterrupted local reference run, trained once per session for
    the local and the Slurm resumes."""
    return train_reference(tmp_path_factory.mktemp("reference"), reference_overrides)


@pytest.fixture(scope="session")
def resubmitted_run(tmp_path_factory) -> ResubmittedRun:
    """tests/resubmitted_run.py's run, submitted three times once per session."""
    return resubmit(tmp_path_factory.mktemp("resubmitted"))


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real single-node Slurm (munge, slurmctld, slurmd from Debian's packages) on localhost,
    started by our own script and stopped after the session."""
    started = subprocess.run(
        ["bash", str(SLURM_SCRIPTS / "start.sh")], capture_output=True, text=True, timeout=900
    )
    if started.returncode != 0:
        pytest.fail(
            "could not start the local Slurm cluster (tests/slurm_cluster/start.sh needs root and "
            f"Debian's packages):\n{started.stdout}\n{started.stderr}"
        )
    yield
    subprocess.run(["bash", str(SLURM_SCRIPTS / "stop.sh")], capture_output=True, timeout=120)


@pytest.fixture(autouse=True)
def no_slurm_job_outlives_its_test(request):
    """Cancel what a Slurm test left queued or running (a failed assertion skips its own
    clean-up): the job would run on, taking the CPUs of the tests after it."""
    yield
    if "slurm_cluster" in request.fixturenames:
        user = f"--user={getpass.getuser()}"
        subprocess.run(["scancel", "--signal=KILL", "--full", user], capture_output=True)
        subprocess.run(["scancel", user], capture_output=True)


@pytest.fixture(scope="module")
def single_rank_group(tmp_path_factory):
    """A one-rank gloo process group in this process, for a module of engine-level tests.
    DeepSpeed caches the world group it first sees: forgotten at setup (another module of
    this process may have built an engine over its own group, since destroyed, e.g. the GPU
    check's one_rank) and at teardown, so each module's engines use its group."""
    from deepspeed.utils import groups

    init_file = tmp_path_factory.mktemp("rendezvous") / "file"  # no port to race for
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # DeepSpeed insists on it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    groups._WORLD_GROUP = None
    yield
    dist.destroy_process_group()
    groups._WORLD_GROUP = None
    if saved is None:
        del os.environ["LOCAL_RANK"]
    else:
        os.environ["LOCAL_RANK"] = saved
