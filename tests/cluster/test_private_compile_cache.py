"""launch.compile_cache: every process that compiles (the job's ranks, verify's, the plan's
tracing, the benches) uses inductor's and Triton's caches in directories of this user's
alone; inductor unpickles what it finds there."""

import os

import pytest
import torch

from slurm_autosp.cluster.compile_cache import use_private_compile_cache
from slurm_autosp.compat import torch_api
from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.config import ActivationCheckpointing, ConfigError, ModelConfig
from slurm_autosp.memory_plan.layer_graph import trace_decoder_layer

CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@pytest.fixture
def no_cache_variables(monkeypatch, tmp_path):
    """An environment as a fresh shell has it, its temporary directory under tmp_path; the
    variables the code under test exports are restored after the test."""
    for name in (*CACHES, "SLURM_TMPDIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    return tmp_path / "node" / f"slurm_autosp_cache_{os.getuid()}"


def test_compile_cache_dir_holds_both_caches_created_private_and_exported(
    no_cache_variables, tmp_path
):
    env = use_private_compile_cache(str(tmp_path / "cache"))
    assert env == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "cache" / "triton"),
    }
    assert {name: os.environ[name] for name in CACHES} == env
    for path in env.values():
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o700)


def test_torchs_default_cache_is_replaced_by_the_node_local_private_one(
    no_cache_variables, monkeypatch
):
    """Importing torch._dynamo exports /tmp/torchinductor_<user>, a name any user can create first."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_api.inductor_default_cache_dir())
    env = use_private_compile_cache(None)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(no_cache_variables / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(no_cache_variables / "triton")


def test_a_cache_directory_others_can_write_is_refused_and_nothing_is_exported(
    no_cache_variables, tmp_path
):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone can replace what is inside
    with pytest.raises(
        ConfigError,
        match=rf"compile cache directory {shared} is owned by uid \d+ or writable by others "
        r"\(mode 777\).*set compile.cache_dir to a directory of your own",
    ):
        use_private_compile_cache(str(shared))
    assert not any(name in os.environ for name in CACHES)


def test_a_cache_directory_that_cannot_be_created_names_the_key(no_cache_variables, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"file/cache: cannot create it .*compile.cache_dir"):
        use_private_compile_cache(str(tmp_path / "file" / "cache"))


def test_the_plans_tracing_uses_the_private_cache_and_leaves_the_environment_as_it_was(
    no_cache_variables, monkeypatch, tmp_path
):
    """Dynamo reads inductor's cache directory while the plan traces a layer; the submitting
    process's environment goes into its job (sbatch exports it), so it is restored after."""
    model, spec = ModelConfig(), ActivationCheckpointSpec(ActivationCheckpointing.none)

    def trace(local_seq: int) -> None:
        trace_decoder_layer(
            model, local_seq=local_seq, sp_size=1, specs=[spec], dtype=torch.float32
        )

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared / "inductor"))
    with pytest.raises(ConfigError, match=rf"{shared} is owned by uid \d+ or writable by others"):
        trace(local_seq=37)  # a length no other test traces: the process keeps traces
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_api.inductor_default_cache_dir())
    trace(local_seq=37)
    assert oct((no_cache_variables / "inductor").stat().st_mode & 0o777) == oct(0o700)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == torch_api.inductor_default_cache_dir()
    assert "TRITON_CACHE_DIR" not in os.environ
