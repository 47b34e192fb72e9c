"""The offline install's wheelhouse: the closure of slurm_autosp's requirements at the versions
installed here, less torch's and less what the target has. (CI installs the fast tier's
oldest-torch venv from such a wheelhouse with no package index: .ci/run.)"""

import sys

import pytest
from slurm_helpers import REPO

sys.path.insert(0, str(REPO / "tools"))
import wheelhouse  # noqa: E402
from wheelhouse import closure, frozen, torch_closure  # noqa: E402

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def test_the_closure_leaves_out_torch_and_what_the_target_has_in_a_version_that_satisfies(
    tmp_path,
):
    everything = closure("slurm_autosp", PYTHON, {}, set())
    assert {"torch", "deepspeed", "transformers", "slurm-autosp"} <= set(everything)
    without_torch = closure("slurm_autosp", PYTHON, {}, torch_closure(PYTHON))
    assert "torch" not in without_torch and "deepspeed" in without_torch
    # a job writes its events with tensorboardX; TensorBoard and matplotlib are the view extra's
    assert "tensorboardx" in without_torch
    assert not {"tensorboard", "matplotlib", "pillow"} & set(without_torch)
    view = closure("slurm_autosp[view]", PYTHON, {}, torch_closure(PYTHON))
    assert {"tensorboard", "matplotlib", "pillow"} <= set(view)
    have = tmp_path / "freeze.txt"
    ours = everything["transformers"].version
    have.write_text(f"transformers=={ours}\n-e git+https://x#egg=y\n")
    kept = closure("slurm_autosp", PYTHON, frozen(have), set())
    assert "transformers" not in kept
    assert "tokenizers" not in kept  # transformers' own needs are the target's
    have.write_text("transformers==4.0.0\n")  # below what slurm_autosp requires: carried
    assert "transformers" in closure("slurm_autosp", PYTHON, frozen(have), set())


def test_a_wheelhouse_over_max_mib_fails_naming_its_size_the_limit_and_the_largest_wheels(
    tmp_path, monkeypatch
):
    for name, mib in (("small-2.0-py3-none-any.whl", 1), ("big-1.0-cp311-abi3-any.whl", 3)):
        (tmp_path / name).write_bytes(b"\0" * mib * 2**20)
    monkeypatch.setattr(wheelhouse, "closure", lambda *args: {})  # nothing to fetch or build
    monkeypatch.setattr(sys, "argv", ["wheelhouse.py", str(tmp_path), "--max-mib", "3.5"])
    with pytest.raises(SystemExit) as refused:  # a message as the code: exit status 1
        wheelhouse.main()
    assert refused.value.code == (
        f"error: wheelhouse {tmp_path} is 4.0 MiB, over the limit of 3.5 MiB; "
        "largest wheels (MiB): big-1.0 3.0, small-2.0 1.0"
    )
    monkeypatch.setattr(sys, "argv", ["wheelhouse.py", str(tmp_path), "--max-mib", "4"])
    wheelhouse.main()  # at the limit
