"""The offline install's wheelhouse: the closure of slurm_autosp's requirements at the versions
installed here, less torch's and less what the target has. (CI installs the fast tier's
oldest-torch venv from such a wheelhouse with no package index: .ci/run.)"""

import sys

from slurm_helpers import REPO

sys.path.insert(0, str(REPO / "tools"))
from wheelhouse import closure, frozen, torch_closure  # noqa: E402

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def test_the_closure_leaves_out_torch_and_what_the_target_has_in_a_version_that_satisfies(
    tmp_path,
):
    everything = closure("slurm_autosp", PYTHON, {}, set())
    assert {"torch", "deepspeed", "transformers", "slurm-autosp"} <= set(everything)
    without_torch = closure("slurm_autosp", PYTHON, {}, torch_closure(PYTHON))
    assert "torch" not in without_torch and "deepspeed" in without_torch
    have = tmp_path / "freeze.txt"
    ours = everything["transformers"].version
    have.write_text(f"transformers=={ours}\n-e git+https://x#egg=y\n")
    kept = closure("slurm_autosp", PYTHON, frozen(have), set())
    assert "transformers" not in kept
    assert "tokenizers" not in kept  # transformers' own needs are the target's
    have.write_text("transformers==4.0.0\n")  # below what slurm_autosp requires: carried
    assert "transformers" in closure("slurm_autosp", PYTHON, frozen(have), set())
