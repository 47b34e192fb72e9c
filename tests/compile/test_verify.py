"""`python -m slurm_autosp verify` passes for AutoSP on shrunk copies of the shipped configs and
fails, naming the shard boundary, when labels are shifted inside each shard."""

import os
import subprocess
import sys

import pytest
from in_process import run_command

from slurm_autosp.commands.verify import main
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.verify import (
    Report,
    VerifyOptions,
    choose_layout,
    failures,
    shrink_model_config,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def run_verify(compile_cache_dir):
    """Run the command as a user would, with the tests' inductor cache."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(compile_cache_dir)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "slurm_autosp", "verify", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run


def test_verify_refuses_a_compile_cache_others_can_write_before_any_rank_starts(
    tmp_path, monkeypatch
):
    """Its ranks compile with inductor, which unpickles its cache: they use compile.cache_dir
    (or the node-local default), checked, never torch's default under /tmp."""
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone can replace what is inside
    done = run_command(
        main,
        "cfg=configs/tiny_cpu.yaml",
        "parallel.sp_size=2",
        "compile.enabled=true",
        f"compile.cache_dir={shared}",
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"compile cache directory {shared} is owned by uid" in done.stderr
    assert "writable by others (mode 777)" in done.stderr and "ranks," not in done.stdout
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


@pytest.mark.slow
def test_per_shard_label_shift_fails_naming_the_shard_boundary(run_verify):
    done = run_verify(
        "cfg=configs/tiny_cpu.yaml",
        "parallel.sp_size=2",
        "compile.enabled=true",
        "verify.inject=per_shard_shift",
        "verify.codegen=false",  # the labels' bug, not inductor's kernels
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout and "MISMATCH" in done.stdout
    assert (
        "last token of an SP shard" in done.stdout
        and "label pair crossing each shard boundary" in done.stdout
    )


@pytest.mark.slow
def test_llama8b_head_layout_with_sp2_and_packed_documents_matches_single_device(run_verify):
    """Three documents per row against the unmodified model trained on each document alone."""
    done = run_verify("cfg=configs/llama8b_32k.yaml", "parallel.sp_size=2", "verify.documents=3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "32 query heads / 8 KV heads (GQA 4:1)" in done.stdout and "PASS" in done.stdout
    assert "packed: 3 documents per row (document_ids), lengths 5, 11, 45" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,layout",
    [
        ("mixtral", ("parallel.sp_size=2", "--dp", "2")),
        ("qwen3_moe", ("parallel.sp_size=4", "parallel.ring_size=2", "cluster.tasks_per_node=4")),
    ],
)
def test_moe_router_loss_matches_single_device(run_verify, family, layout):
    """The router's load-balancing loss over each DP replica's micro-batch, as the unmodified
    model computes it on one device (before: gate gradients 0.05-1.5 relative off): SP=2 x
    DP=2, and Ulysses 2 x ring 2 (the command's 4 ranks laid out as a job's)."""
    done = run_verify(
        "cfg=configs/tiny_cpu.yaml",
        f"model.model_type={family}",
        "model.extra.output_router_logits=true",
        "verify.codegen=false",  # the router loss's split, not inductor's kernels
        *layout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout
    expected = "sp_size=2 x dp=2" if "--dp" in layout else "sp_size=4 (Ulysses 2 x ring 2) x dp=1"
    assert expected in done.stdout, done.stdout


LORA_ULYSSES2_RING2 = ("parallel.sp_size=4", "parallel.ring_size=2", "cluster.tasks_per_node=4")
LORA_CASES = {
    "llama_sp2": ("parallel.sp_size=2",),  # inductor's kernels too
    "qwen3_sp2": ("model.model_type=qwen3", "parallel.sp_size=2", "verify.codegen=false"),
    "llama_ulysses2_ring2": (*LORA_ULYSSES2_RING2, "verify.codegen=false"),
    "qwen3_ulysses2_ring2": (
        "model.model_type=qwen3",
        *LORA_ULYSSES2_RING2,
        "verify.codegen=false",
    ),
    "llama_sp2_documents": ("parallel.sp_size=2", "verify.documents=3", "verify.codegen=false"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", LORA_CASES.values(), ids=LORA_CASES.keys())
def test_lora_adapters_drawn_at_random_train_as_on_one_device(run_verify, case):
    """Issue #51: a tiny Llama and a tiny Qwen3 with LoRA on every default projection, both
    adapter matrices random (with B zero A's gradients would be zero), at SP=2, at Ulysses 2 x
    ring 2 and with packed documents: the adapters' gradients, the only ones trained, within
    1e-5 of one device's."""
    done = run_verify("cfg=configs/tiny_cpu.yaml", "model.lora={}", *case)
    print(done.stdout)  # its errors, for the -rP report
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout, done.stdout
    family = "qwen3" if "model.model_type=qwen3" in case else "llama"
    assert f"AutoSP verify: {family}, " in done.stdout, done.stdout
    assert (
        "LoRA rank 16 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj "
        "(adapters random)" in done.stdout
    ), done.stdout
    # 2 layers x 7 adapted projections x (A, B): the frozen base has no gradients to compare
    assert "gradients, worst of 28 parameters" in done.stdout, done.stdout
    listed = done.stdout.split("worst parameters:\n", 1)[1].split("PASS", 1)[0].split()[::2]
    assert listed and all(".lora_A." in n or ".lora_B." in n for n in listed), listed
    if "parallel.ring_size=2" in case:
        assert "sp_size=4 (Ulysses 2 x ring 2) x dp=1" in done.stdout, done.stdout
    if "verify.documents=3" in case:
        assert "packed: 3 documents per row (document_ids)" in done.stdout, done.stdout


def test_shrunk_model_keeps_the_lora_adapters_without_dropout():
    """verify checks the configured adapters (rank, alpha, layers) on the shrunk copy, their
    dropout off: each rank would draw its own masks."""
    model = load_config(
        [
            "cfg=configs/tiny_cpu.yaml",
            "parallel.sp_size=1",
            "model.lora={}",
            "model.lora.rank=4",
            "model.lora.alpha=8",
            "model.lora.dropout=0.1",
            "model.lora.target_modules=[q_proj,v_proj]",
        ]
    ).model
    shrunk = shrink_model_config(model, VerifyOptions())
    assert shrunk.lora is not None and shrunk.lora.dropout == 0.0
    assert (shrunk.lora.rank, shrunk.lora.alpha) == (4, 8)
    assert shrunk.lora.target_modules == ["q_proj", "v_proj"]
    assert model.lora.dropout == 0.1  # the job's own config untouched
    plain = load_config(["cfg=configs/tiny_cpu.yaml"]).model
    assert shrink_model_config(plain, VerifyOptions()).lora is None


RING_LAYOUTS = {"ulysses2_ring2": "parallel.ring_size=2", "ring4": "parallel.ring_size=4"}


@pytest.mark.slow
@pytest.mark.parametrize("ring", RING_LAYOUTS.values(), ids=RING_LAYOUTS.keys())
def test_packed_documents_and_a_window_under_a_ring_match_single_device(run_verify, ring):
    """Three packed documents a row, Mistral's window of 7 tokens, one KV head, 123 tokens
    (odd: padded to 128), over 4 ranks as Ulysses 2 x ring 2 and as a ring of 4."""
    done = run_verify(
        "cfg=configs/tiny_cpu.yaml",
        "parallel.sp_size=4",
        ring,
        "cluster.tasks_per_node=4",
        "verify.documents=3",
        "verify.seq_len=123",
        "model.model_type=mistral",
        "model.extra.sliding_window=7",
        "model.num_key_value_heads=1",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "3 documents per row" in done.stdout, done.stdout


@pytest.mark.parametrize(
    "seq_len,sp_size,documents",
    [(61, 2, 3), (61, 2, 2), (61, 2, 17), (125, 4, 2), (125, 4, 6), (3, 2, 2)],
)
def test_packed_layout_spans_a_boundary_holds_a_short_document_and_a_tail_only_shard(
    seq_len, sp_size, documents
):
    layout = choose_layout(seq_len, sp_size, documents)
    assert layout == choose_layout(seq_len, sp_size, documents)  # deterministic
    assert sum(layout.lengths) == seq_len and len(layout.lengths) == documents
    assert len(set(layout.lengths)) > 1 and min(layout.lengths) >= 1
    assert layout.spanning() and layout.shorter_than_shard()
    tails = layout.tail_only_shards()
    assert tails
    for shard in tails:  # no document starts there: its rank sees only a tail
        assert not any(
            shard * layout.shard_len <= s < (shard + 1) * layout.shard_len for s in layout.starts
        )


def test_the_default_layout_and_its_document_ids():
    layout = choose_layout(61, 2, 3)  # 2 shards of 31 (the last padded by one)
    assert layout.lengths == (5, 11, 45) and layout.starts == [0, 5, 16]
    assert (layout.spanning(), layout.shorter_than_shard(), layout.tail_only_shards()) == (
        [2],
        [0, 1],
        [1],
    )
    assert layout.document_ids().tolist() == [0] * 5 + [1] * 11 + [2] * 45


@pytest.mark.parametrize(
    "documents,sp_size,message",
    [
        (18, 2, "leave 16 tokens before the document that ends the row, too few for 17 more"),
        (62, 2, "is more documents than the row's 61 tokens"),
        (1, 2, "need 2 or more documents over 2 or more shards"),
        (3, 1, "need 2 or more documents over 2 or more shards"),
    ],
)
def test_layouts_that_cannot_be_had_are_refused_naming_the_key(documents, sp_size, message):
    with pytest.raises(ConfigError, match=f"verify.documents={documents}") as refused:
        choose_layout(61, sp_size, documents)
    assert message in str(refused.value)


def test_bad_document_counts_exit_2_naming_the_key(capsys):
    assert main(["cfg=configs/tiny_cpu.yaml", "parallel.sp_size=2", "verify.documents=-1"]) == 2
    assert "verify.documents=-1 must be >= 0" in capsys.readouterr().err
    assert main(["cfg=configs/tiny_cpu.yaml", "parallel.sp_size=2", "verify.documents=100"]) == 2
    assert (
        "verify.documents=100 is more documents than the row's 61 tokens" in capsys.readouterr().err
    )


def test_shrunk_model_keeps_the_configured_window_fields():
    model = load_config(
        [
            "cfg=configs/tiny_cpu.yaml",
            "model.model_type=qwen2",
            "model.extra.use_sliding_window=true",
            "model.extra.sliding_window=64",
            "model.extra.max_window_layers=1",
        ]
    ).model
    shrunk = shrink_model_config(model, VerifyOptions())
    assert (shrunk.extra["use_sliding_window"], shrunk.extra["sliding_window"]) == (True, 64)
    assert shrunk.extra["max_window_layers"] == 1


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
