"""`python -m slurm_autosp.verify` passes for AutoSP on shrunk copies of the shipped configs and
fails, naming the shard boundary, when labels are shifted inside each shard."""

import os
import subprocess
import sys

import pytest

from slurm_autosp.config import load_config
from slurm_autosp.verify import Report, VerifyOptions, failures, main, shrink_model_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def run_verify(tmp_path_factory):
    """Run the command as a user would, with one inductor cache for this module's runs."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("verify_inductor_cache")),
    }

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "slurm_autosp.verify", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run


@pytest.mark.slow
def test_per_shard_label_shift_fails_naming_the_shard_boundary(run_verify):
    done = run_verify(
        "cfg=configs/tiny_cpu.yaml",
        "parallel.sp_size=2",
        "compile.enabled=true",
        "verify.inject=per_shard_shift",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout and "MISMATCH" in done.stdout
    assert (
        "last token of an SP shard" in done.stdout
        and "label pair crossing each shard boundary" in done.stdout
    )


@pytest.mark.slow
def test_llama8b_head_layout_with_sp2_matches_single_device(run_verify):
    done = run_verify("cfg=configs/llama8b_32k.yaml", "parallel.sp_size=2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "32 query heads / 8 KV heads (GQA 4:1)" in done.stdout and "PASS" in done.stdout


@pytest.mark.parametrize(
    "path,heads,kv_heads",
    [("configs/llama8b_32k.yaml", 32, 8), ("configs/llama70b_128k.yaml", 64, 8)],
)
def test_shrunk_model_keeps_head_layout_class_and_rope(path, heads, kv_heads):
    model = load_config([f"cfg={path}"]).model
    small = shrink_model_config(model, VerifyOptions())
    assert (small.num_attention_heads, small.num_key_value_heads) == (heads, kv_heads)
    assert (small.num_hidden_layers, small.head_dim, small.vocab_size) == (2, 8, 256)
    assert small.hidden_size == heads * 8 and small.model_type == model.model_type
    assert small.extra["rope_parameters"] == model.extra["rope_parameters"]


def test_mismatch_only_at_shard_ends_is_explained_as_a_per_shard_shift():
    report = Report(
        "",
        sp_size=2,
        seq_len=61,
        shard_len=31,
        loss=5.5,
        ref_loss=5.5,
        token_error=5.6,
        mismatched_positions=[30],
        grad_errors={"lm_head.weight": 1e-7},
    )
    assert any("last token of an SP shard" in line for line in failures(report, 1e-5))
    report.mismatched_positions = [12, 30]
    assert not any("last token of an SP shard" in line for line in failures(report, 1e-5))


def test_bad_arguments_exit_2_naming_the_key(capsys):
    assert main(["cfg=configs/tiny_cpu.yaml", "verify.sequence=64"]) == 2
    assert "verify.sequence" in capsys.readouterr().err
    assert main(["cfg=configs/tiny_cpu.yaml", "train.stepz=3"]) == 2
    assert "train.stepz" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "per_shard_shift" in capsys.readouterr().out


def test_shrunk_model_moves_special_token_ids_into_the_shrunk_vocabulary():
    """Phi-3's pad id 32000 (its HF default) would not embed in a 256-token vocabulary."""
    model = load_config(["cfg=configs/tiny_cpu.yaml", "model.model_type=phi3"]).model
    shrunk = shrink_model_config(model, VerifyOptions())
    assert shrunk.extra["pad_token_id"] == 255
    assert all(shrunk.extra.get(k, 0) < 256 for k in ("bos_token_id", "eos_token_id"))
