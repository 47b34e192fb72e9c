"""The model comes from an HF config, a local checkpoint, or the user's own builder."""

import pytest
import torch
from transformers.models.mixtral import modeling_mixtral

from slurm_autosp.checkpoint.export import export_hf, whole_weights
from slurm_autosp.compile import tile_layers, tile_mlps
from slurm_autosp.compile.backend import AutoSPCompileError
from slurm_autosp.config import ConfigError, ModelConfig, load_config
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.model import build_model
from slurm_autosp.model_refusals import refuse_tiled_router_loss, refuse_unsupported_attention


def tiny_builder(cfg):
    return torch.nn.Linear(cfg.hidden_size, cfg.vocab_size)


def test_hf_fields_reach_the_hf_config_unchanged():
    model = build_model(ModelConfig(num_key_value_heads=1, extra={"rms_norm_eps": 1e-3}))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads == 1 and model.config.rms_norm_eps == 1e-3
    assert model.config._attn_implementation == "sdpa"


def test_local_pretrained_path_loads_the_saved_weights(tmp_path):
    saved = build_model(ModelConfig(model_type="qwen2", num_key_value_heads=1))
    saved.save_pretrained(tmp_path)
    loaded = build_model(ModelConfig(pretrained_path=str(tmp_path)))
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    for (name, a), (_, b) in zip(
        saved.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_user_builder_is_called_with_the_model_config():
    model = build_model(ModelConfig(builder=f"{__name__}:tiny_builder"))
    assert isinstance(model, torch.nn.Linear) and model.out_features == 256


def test_unimportable_builder_is_explained():
    with pytest.raises(ConfigError, match=r"model\.builder='nowhere\.mod:fn': cannot import it"):
        build_model(ModelConfig(builder="nowhere.mod:fn"))


def test_unknown_model_type_is_named():
    with pytest.raises(ConfigError, match=r"model\.model_type='llamma'"):
        build_model(ModelConfig(model_type="llamma"))


def test_an_export_killed_half_way_leaves_the_previous_model_whole(tmp_path):
    model = build_model(ModelConfig())
    export_hf(model, tmp_path)
    before = sorted(p.name for p in RunDir(tmp_path).hf_export.iterdir())

    def killed():  # after a few shards of the new export are written
        for number, weight in enumerate(whole_weights(model)):
            if number == 6:
                raise KeyboardInterrupt
            yield weight

    with pytest.raises(KeyboardInterrupt):
        export_hf(model, tmp_path, killed(), max_shard_bytes=20_000)
    assert len(list(RunDir(tmp_path).hf_export_partial.glob(".shard-*"))) >= 2
    assert sorted(p.name for p in RunDir(tmp_path).hf_export.iterdir()) == before
    assert (RunDir(tmp_path).hf_export / "model.safetensors").stat().st_size > 1000


def test_a_pretrained_path_without_a_config_is_named(tmp_path):
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", f"model.pretrained_path={tmp_path}"])
    with pytest.raises(
        ConfigError, match=rf"model.pretrained_path={tmp_path}: no config.json there"
    ):
        refuse_unsupported_attention(cfg)


def test_a_model_transformers_cannot_run_with_sdpa_gets_our_message():
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", "model.model_type=gemma2"])
    with pytest.raises(
        ConfigError, match=r'cannot run Gemma2ForCausalLM with attn_implementation="sdpa"'
    ):
        refuse_unsupported_attention(cfg)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe"])
def test_moe_families_whose_router_loss_is_ours_are_admitted(family):
    refuse_unsupported_attention(
        load_config(
            [
                "cfg=configs/tiny_cpu.yaml",
                f"model.model_type={family}",
                "model.extra.output_router_logits=true",
            ]
        )
    )


@pytest.mark.parametrize(
    "family,why",
    [
        ("doge", "load_balancing_loss_func(logits, num_experts, top_k, mask) fails"),
        ("jetmoe", "JetMoeForCausalLM keeps no router_aux_loss_coef"),
    ],
)
def test_a_moe_family_with_another_router_loss_is_refused_naming_output_router_logits(family, why):
    """On one device too: the router loss is sp.router_loss's on every layout (Doge's own
    attention mask would be refused first under SP)."""
    cfg = load_config(
        [
            "cfg=configs/tiny_cpu.yaml",
            f"model.model_type={family}",
            "model.extra.output_router_logits=true",
            "parallel.sp_size=1",
            "compile.enabled=false",
        ]
    )
    with pytest.raises(ConfigError, match="set model.extra.output_router_logits=false") as refused:
        refuse_unsupported_attention(cfg)
    assert why in str(refused.value)
    cfg.model.extra["output_router_logits"] = False
    refuse_unsupported_attention(cfg)


def test_a_router_loss_that_counts_padding_is_refused_by_what_it_computes(monkeypatch):
    """The check compares values and gradients, so a family is refused for its semantics
    (here: padding counted), not for its name."""
    original = modeling_mixtral.load_balancing_loss_func
    monkeypatch.setattr(
        modeling_mixtral,
        "load_balancing_loss_func",
        lambda logits, experts, top_k, mask=None: original(logits, experts, top_k, None),
    )
    cfg = load_config(
        [
            "cfg=configs/tiny_cpu.yaml",
            "model.model_type=mixtral",
            "model.extra.output_router_logits=true",
        ]
    )
    with pytest.raises(ConfigError, match="differs with a padding mask.*output_router_logits"):
        refuse_unsupported_attention(cfg)


def test_a_z_loss_is_refused_naming_its_field():
    cfg = load_config(
        [
            "cfg=configs/tiny_cpu.yaml",
            "model.model_type=mixtral",
            "model.extra.router_z_loss_coef=0.001",
        ]
    )
    with pytest.raises(ConfigError, match=r"z-loss \(router_z_loss_coef=0.001\).*=0"):
        refuse_unsupported_attention(cfg)


def test_sequence_tiling_with_a_router_loss_is_refused_at_admission_and_where_it_runs():
    """Tiles run the MoE block without autograd and again in backward: the router's logits
    would be recorded per tile and pass, without their gradient."""
    cfg = load_config(
        [
            "cfg=configs/tiny_cpu.yaml",
            "model.model_type=mixtral",
            "model.extra.output_router_logits=true",
        ]
    )
    with pytest.raises(ConfigError, match=r"compile.tile_tokens=64 .*output_router_logits=false"):
        refuse_tiled_router_loss(cfg.model, 64)
    model = build_model(cfg.model)
    with pytest.raises(AutoSPCompileError, match="output_router_logits=true"):
        tile_mlps(model, 64)
    with pytest.raises(AutoSPCompileError, match="output_router_logits=true"):
        tile_layers(model, 64)
    cfg.model.extra["output_router_logits"] = False
    refuse_tiled_router_loss(cfg.model, 64)
    tile_mlps(build_model(cfg.model), 64)
