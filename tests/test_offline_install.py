"""The offline install: `./install.sh --download DIR` writes a wheelhouse of what is installed
here, and `./install.sh --offline DIR` installs from it into a fresh environment that has its
own torch, with no package index (pip's configuration ignored, so no other wheel is found)."""

import os
import subprocess
import sys
import zipfile

import pytest
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


@pytest.mark.slow
def test_a_wheelhouse_without_torch_installs_into_a_fresh_venv_with_no_package_index(tmp_path):
    house = tmp_path / "wheels"
    made = subprocess.run(
        ["./install.sh", "--download", str(house), "--no-torch"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert made.returncode == 0, made.stderr
    assert "without torch, " in made.stdout
    wheels = {p.name.split("-")[0].lower(): p for p in house.glob("*.whl")}
    assert "torch" not in wheels and not any(name.startswith("nvidia") for name in wheels)
    for built in ("deepspeed", "slurm_autosp"):  # pure Python: no op compiled in
        assert wheels[built].name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheels["deepspeed"]) as deepspeed:
        assert (
            "'fused_adam': False"
            in deepspeed.read("deepspeed/git_version_info_installed.py").decode()
        )

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    torch_version = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__.split('+')[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    subprocess.run(
        [python, "-m", "pip", "install", "-q", f"torch=={torch_version}"], check=True, timeout=600
    )
    offline = {  # no index and no other wheels: pip's configuration and variables left out
        **{k: v for k, v in os.environ.items() if not k.startswith("PIP_")},
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
    }
    installed = subprocess.run(
        ["./install.sh", "--offline", str(house)],
        cwd=REPO,
        env=offline,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr
    assert f"slurm_autosp installed: torch {torch_version}" in installed.stdout
    console = subprocess.run(
        [str(venv / "bin" / "slurm-autosp"), "--help"], capture_output=True, text=True, cwd=tmp_path
    )
    assert console.returncode == 0 and "submit" in console.stdout
