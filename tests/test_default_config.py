"""A command given no cfg= trains the tiny default, the config README's first command names."""

from pathlib import Path

from slurm_autosp.commands import submit as submit_command
from slurm_autosp.config import DEFAULT_CONFIG, load_config, with_default_config

REPO = Path(__file__).resolve().parents[1]
TINY = f"cfg={REPO / 'configs' / 'tiny_cpu.yaml'}"


def test_no_cfg_loads_the_tiny_config_readme_trains():
    default = load_config(with_default_config([]))
    assert default == load_config([TINY])  # run.name included: one file, tiny_cpu
    assert (default.parallel.sp_size, default.compile.enabled, default.train.steps) == (2, True, 60)


def test_configs_tiny_cpu_is_the_packaged_default():
    assert (REPO / "configs" / "tiny_cpu.yaml").resolve() == DEFAULT_CONFIG.resolve()


def test_the_wheel_ships_the_default_config():
    # read as text: tomllib is Python 3.11's, and the project supports 3.10
    pyproject = (REPO / "pyproject.toml").read_text()
    section = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert f'"slurm_autosp.config" = ["{DEFAULT_CONFIG.name}"]' in section
    assert DEFAULT_CONFIG.parent == REPO / "slurm_autosp" / "config"


def test_overrides_apply_to_the_default_and_a_given_cfg_replaces_it():
    assert load_config(with_default_config(["train.steps=3"])).train.steps == 3
    given = ["cfg=configs/llama8b_32k.yaml", "train.steps=3"]
    assert with_default_config(given) == given


def test_submit_without_arguments_submits_the_tiny_default(monkeypatch):
    submitted = []
    monkeypatch.setattr(submit_command, "submit", lambda cfg, force: submitted.append(cfg) or 0)
    assert submit_command.main([]) == 0
    assert submitted == [load_config([TINY])]
