"""Attention that the AutoSP graph does not compute (chunks shorter than the sequence, sliding
windows in tiled layers, soft-capping, sinks, bidirectional or linear mixing, custom masks) is
refused by name: from the config before a job starts, and where the model runs. Never trained
silently wrong. Sliding windows are computed (test_sliding_windows) and accepted here."""

import pytest
import torch
from in_process import run_command
from reference_run import prepared_dataset
from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig

from slurm_autosp.commands.plan import main as plan_main
from slurm_autosp.commands.run import main as run_main
from slurm_autosp.commands.submit import main as submit_main
from slurm_autosp.commands.verify import main as verify_main
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.model_refusals import refuse_unsupported_attention
from slurm_autosp.sp import prepare_sp_inputs
from slurm_autosp.sp.attention_pattern import (
    UnsupportedAttention,
    check_attention_call,
    check_mask_request,
)
from slurm_autosp.sp.chunked_loss import causal_lm_loss

TINY = "cfg=configs/tiny_cpu.yaml"


def refusal(*overrides: str) -> str:
    """The message refusing the tiny config with `overrides`; '' when it is accepted."""
    try:
        refuse_unsupported_attention(load_config([TINY, *overrides]))
    except ConfigError as err:
        return str(err)
    return ""


def test_sliding_windows_shorter_than_the_sequence_are_accepted():
    assert refusal("model.model_type=mistral", "model.extra.sliding_window=16") == ""
    assert (
        refusal(
            "model.model_type=qwen2",
            "model.num_hidden_layers=4",
            "model.extra.use_sliding_window=true",
            "model.extra.sliding_window=32",
            "model.extra.max_window_layers=2",
        )
        == ""
    )


def test_chunked_attention_shorter_than_the_sequence_is_refused_naming_it():
    message = refusal("model.model_type=llama4_text", "model.extra.attention_chunk_size=16")
    assert (
        "chunked attention (attention_chunk_size=16 on layers 0, 1 of 2) over 256 tokens" in message
    )
    assert "data.seq_len <= 16 is exact" in message


@pytest.mark.parametrize(
    "model_type, named",
    [
        ("gemma2", "attention logit soft-capping (attn_logit_softcapping=50.0)"),
        ("gpt_oss", "attention sinks (self_attn.sinks of GptOssDecoderLayer)"),
        (
            "qwen3_next",
            "linear_attention (layers 0, 1 of 2) mixes tokens along the sequence outside attention",
        ),
        ("cohere2", "logit_scale=0.0625: the chunked loss does not apply"),
    ],
)
def test_other_attention_features_are_refused_by_name(model_type, named):
    assert named in refusal(f"model.model_type={model_type}", "data.seq_len=64")


def test_bidirectional_attention_is_refused():
    assert "bidirectional attention" in refusal(
        "model.model_type=gemma3_text",
        "model.extra.use_bidirectional_attention=true",
        "data.seq_len=64",
    )


def test_plain_causal_models_are_accepted():
    assert refusal() == ""
    assert refusal("model.model_type=qwen2") == ""


def test_without_autosp_a_chunk_is_the_model_own_business():
    assert (
        refusal(
            "model.model_type=llama4_text",
            "model.extra.attention_chunk_size=16",
            "compile.enabled=false",
            "parallel.sp_size=1",
        )
        == ""
    )


@pytest.mark.slow
def test_verify_passes_the_sliding_window_command(capsys):
    """The issue's acceptance command: a 16-token window on verify's 61-token sequences."""
    code = verify_main(
        [TINY, "parallel.sp_size=2", "model.model_type=mistral", "model.extra.sliding_window=16"]
    )
    assert code == 0 and "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("main", [submit_main, run_main, plan_main], ids=["submit", "run", "plan"])
def test_every_command_refuses_before_starting(main, tmp_path):
    proc = run_command(
        main,
        TINY,
        "model.model_type=llama4_text",
        "model.extra.attention_chunk_size=16",
        f"run.output_root={tmp_path}",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "attention_chunk_size=16 on layers 0, 1 of 2" in proc.stderr
    assert not any(tmp_path.iterdir()), "nothing may be written for a refused job"


def test_a_custom_4d_mask_is_refused_by_prepare_sp_inputs():
    ids = torch.randint(0, 256, (1, 8))
    with pytest.raises(ValueError, match="custom attention masks"):
        prepare_sp_inputs(ids, attention_mask=torch.ones(1, 1, 8, 8), sp_rank=0, sp_size=2)


@pytest.mark.parametrize(
    "asked, named",
    [
        ({"softcap": 50.0}, "soft-capping"),
        ({"s_aux": torch.zeros(2)}, "attention sinks"),
        ({"is_causal": False}, "not causal"),
        ({"position_bias": torch.zeros(1)}, "position bias"),
    ],
)
def test_what_an_attention_layer_asks_beyond_causal_sdpa_is_refused_where_it_runs(asked, named):
    """HF's SDPA function ignores softcap and s_aux (Gemma 2's and GPT-OSS's layers pass them)."""
    with pytest.raises(UnsupportedAttention, match=named):
        check_attention_call(torch.nn.Identity(), asked)
    check_attention_call(torch.nn.Identity(), {"is_causal": True, "scaling": 0.1})


def test_a_sliding_window_mask_passes_where_the_attention_applies_it_not_in_tiled_layers():
    """Tiled layers attend over the whole row: their mask function refuses the window."""
    config = MistralConfig(sliding_window=16)
    check_mask_request(None, 16, 96, config, applies_windows=True)
    with pytest.raises(UnsupportedAttention, match="attention of 16 tokens over a sequence of 96"):
        check_mask_request(None, 16, 96, config, applies_windows=False)
    with pytest.raises(UnsupportedAttention, match="attention of 12 tokens over a sequence of 96"):
        check_mask_request(None, 12, 96, config, applies_windows=True)  # not the config's window


def test_chunked_loss_refuses_a_model_that_transforms_its_logits():
    model = Gemma2ForCausalLM(
        Gemma2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=64,
            attn_implementation="eager",
        )
    )
    batch = prepare_sp_inputs(torch.randint(0, 64, (1, 8)), sp_rank=0, sp_size=1)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        causal_lm_loss(model, batch.model_kwargs(8), chunk_tokens=4)


@pytest.mark.parametrize("case", ["window", "documents"])
def test_gpu_jobs_get_windows_and_documents_in_bf16_on_nvidia_and_fp32_or_rocm_is_refused(
    case, tmp_path
):
    """On GPU ranks document_attention runs the flash varlen kernel: bf16 on NVIDIA GPUs is
    accepted; fp32 (flash has no fp32 kernel) and AMD GPUs (untested) are refused at submit,
    naming the key, not at the first step."""
    if case == "window":
        overrides = ["model.model_type=mistral", "model.extra.sliding_window=4096"]
        named = "sliding-window attention (sliding_window=4096"
    else:
        data = prepared_dataset(tmp_path / "prepared", [3000, 70000])
        overrides = ["data.source=tokens", f"data.path={data}", "data.documents=masked"]
        named = "per-document attention (data.documents=masked)"
    gpu = ["cfg=configs/llama8b_32k.yaml", *overrides]
    refuse_unsupported_attention(load_config(gpu))
    for key, why in [
        ("train.precision=fp32", "in fp32 on GPUs (train.precision=fp32)"),
        ("cluster.vendor=amd", "on AMD GPUs (cluster.vendor=amd)"),
    ]:
        with pytest.raises(ConfigError) as refused:
            refuse_unsupported_attention(load_config([*gpu, key]))
        assert named in str(refused.value) and why in str(refused.value)
    refuse_unsupported_attention(load_config(["cfg=configs/tiny_cpu.yaml", *overrides]))


def test_fp32_on_gpus_is_refused_where_ranks_keep_grouped_kv_heads_which_only_the_math_kernel_takes():
    """Llama-8B's 32 query / 8 key-value heads stay grouped on each of 8 ranks (4 to 1): in
    fp32 on GPUs SDPA would run its math kernel over 32,768 x 32,768 scores per head. bf16, CPU
    ranks, and heads repeated to one key/value head per query head are accepted."""
    gpu = ["cfg=configs/llama8b_32k.yaml"]
    with pytest.raises(ConfigError, match=r"grouped key/value heads in fp32 on GPUs") as refused:
        refuse_unsupported_attention(load_config([*gpu, "train.precision=fp32"]))
    assert "32 query and 8 key/value heads over 8 Ulysses ranks" in str(refused.value)
    assert "32,768 x 32,768" in str(refused.value) and "train.precision=bf16" in str(refused.value)
    refuse_unsupported_attention(load_config(gpu))
    refuse_unsupported_attention(
        load_config([*gpu, "train.precision=fp32", "model.num_key_value_heads=32"])
    )
    refuse_unsupported_attention(load_config(["cfg=configs/tiny_cpu.yaml"]))  # 4 / 2 heads, CPU
