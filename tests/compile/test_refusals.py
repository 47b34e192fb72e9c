"""What AutoSP cannot make sequence parallel fails early, saying what to change."""

import pytest
import torch
import torch.nn.functional as F
from sp_cases import tiny_model

from slurm_autosp.compile import AutoSPBackend, AutoSPCompileError, compile_model


def _compile_attention(fn, *inputs):
    torch._dynamo.reset()
    return torch.compile(fn, backend=AutoSPBackend(2), fullgraph=True)(*inputs)


def test_hf_model_with_eager_attention_is_refused_naming_sdpa():
    with pytest.raises(
        AutoSPCompileError, match='attn_implementation="eager".*attn_implementation="sdpa"'
    ):
        compile_model(
            tiny_model("llama", 2, attn_implementation="eager"), AutoSPBackend(2), per_layer=False
        )


def test_model_without_sdpa_fails_after_the_first_step():
    backend = AutoSPBackend(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(2, 8))
    with pytest.raises(AutoSPCompileError, match="no scaled_dot_product_attention found"):
        backend.require_sdpa_found()


def test_attention_with_an_explicit_mask_is_refused():
    q = torch.randn(1, 4, 8, 2)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    with pytest.raises(Exception, match="receives an attn_mask.*prepare_sp_inputs"):
        _compile_attention(
            lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m), q, mask
        )


def test_non_causal_attention_is_refused():
    with pytest.raises(Exception, match="not causal"):
        _compile_attention(
            lambda q: F.scaled_dot_product_attention(q, q, q), torch.randn(1, 4, 8, 2)
        )


def test_hf_model_called_with_an_attention_mask_is_refused():
    model = tiny_model("llama", 2)
    compile_model(model, AutoSPBackend(2), per_layer=False)
    ids = torch.randint(0, 256, (1, 8))
    with pytest.raises(AutoSPCompileError, match="prepare_sp_inputs"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
