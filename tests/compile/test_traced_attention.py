"""The heads Ulysses splits come from the tensors a model's attention receives, not from a
config field; a model that fails on its own is refused by name before any rank starts (issue
#35, part 2). All on fake tensors or one tiny CPU forward: no rank is started."""

import pytest
import torch
from transformers import AutoConfig

from slurm_autosp import submit
from slurm_autosp.commands.verify import main
from slurm_autosp.compile.traced_attention import trace_attention
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.model import build_model
from slurm_autosp.model_refusals import refuse_unsupported_attention
from slurm_autosp.verify import VerifyOptions, shrink_model_config

TINY = "cfg=configs/tiny_cpu.yaml"
MLA = [
    "model.model_type=deepseek_v3",
    "model.extra.n_routed_experts=4",
    "model.extra.num_experts_per_tok=2",
    "model.extra.moe_intermediate_size=32",
    "model.extra.n_group=1",
    "model.extra.topk_group=1",
]


def test_grouped_query_heads_are_read_from_the_call():
    traced = trace_attention(AutoConfig.for_model("llama", **_tiny(num_key_value_heads=2)))
    assert (traced.layer, traced.query_heads, traced.kv_heads) == ("LlamaAttention", 4, 2)
    assert traced.failure is None and not traced.unsupported


def test_mla_expands_its_key_value_heads_to_every_query_head():
    """DeepSeek-V3 projects keys and values for every head from one latent: 4 and 4."""
    traced = trace_attention(AutoConfig.for_model("deepseek_v3", **_tiny(num_key_value_heads=4)))
    assert (traced.layer, traced.query_heads, traced.kv_heads) == ("DeepseekV3Attention", 4, 4)


@pytest.mark.parametrize("command", [main, submit.main], ids=["verify", "submit"])
def test_mla_with_fewer_key_value_heads_is_refused_naming_the_field(command, capsys, tmp_path):
    """It fails without AutoSP (transformers repeats the 4 heads it receives to 8): verify and
    submit exit 2 before any rank starts, naming the field and the value that works, never a
    traceback."""
    arguments = [TINY, *MLA, "model.num_key_value_heads=2", "parallel.sp_size=2"]
    dry_run = [f"run.output_root={tmp_path}", "dry_run=true"] if command is submit.main else []
    assert command([*arguments, *dry_run]) == 2
    err = capsys.readouterr().err
    assert "model.model_type=deepseek_v3: the model fails on its own" in err
    assert "DeepseekV3Attention) receives 4 query and 4 key/value heads" in err
    assert "set model.num_key_value_heads=4" in err and "Traceback" not in err


def test_mla_with_as_many_key_value_heads_is_admitted_and_shrinks_consistently():
    cfg = load_config([TINY, *MLA, "model.num_key_value_heads=4", "parallel.sp_size=2"])
    refuse_unsupported_attention(cfg)
    shrunk = shrink_model_config(cfg.model, VerifyOptions())
    assert shrunk.extra["qk_rope_head_dim"] == shrunk.head_dim == 8  # rotary fits the queries
    ids = torch.randint(0, 256, (1, 9))
    assert build_model(shrunk)(input_ids=ids, labels=ids).loss.isfinite()


def test_a_model_calling_attention_its_own_way_is_refused_by_name():
    with pytest.raises(ConfigError, match="FalconForCausalLM calls no attention function"):
        refuse_unsupported_attention(load_config([TINY, "model.model_type=falcon"]))


def test_verify_refuses_a_shrunk_copy_that_fails_on_one_device(capsys):
    """GPT-J's 64 rotary dimensions do not fit heads of 8: its own forward fails."""
    assert main([TINY, "model.model_type=gptj", "parallel.sp_size=2"]) == 2
    err = capsys.readouterr().err
    assert "verify's shrunk copy (2 layers, hidden 32, head_dim 8) fails on its own" in err


def _tiny(**fields):
    return dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        **fields,
    )
