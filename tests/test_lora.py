"""LoRA's parts without ranks: the adapters PEFT injects and what trains, the merged weights,
the adapter's names as PEFT saves them, and the base's fingerprint that refuses another base."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from slurm_autosp.checkpoint import export
from slurm_autosp.checkpoint.identity import refused, run_settings
from slurm_autosp.cluster.placement import layout_for
from slurm_autosp.config import ConfigError, LoraConfig, load_config
from slurm_autosp.lora import (
    adapter_state,
    base_fingerprint,
    base_weights,
    merged_weights,
    randomize_adapters,
)
from slurm_autosp.model import build_model

LORA = ["model.lora={}", "model.lora.rank=4", "model.lora.alpha=8"]


def tiny(*overrides: str):
    torch.manual_seed(0)
    return build_model(load_config(["cfg=configs/tiny_cpu.yaml", *LORA, *overrides]).model)


def test_only_the_adapters_train_and_the_adapted_model_computes_the_base_at_first():
    adapted = tiny()
    torch.manual_seed(0)
    plain = build_model(load_config(["cfg=configs/tiny_cpu.yaml"]).model)
    trained = [n for n, p in adapted.named_parameters() if p.requires_grad]
    # 2 layers x 7 projections x (A, B)
    assert len(trained) == 28 and all(".lora_" in n for n in trained)
    assert "lm_head.weight" in base_weights(adapted) and not base_weights(plain)
    tokens = torch.randint(0, 256, (1, 16))
    assert torch.equal(adapted(input_ids=tokens).logits, plain(input_ids=tokens).logits)


def test_target_modules_the_model_lacks_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"model.lora.target_modules=\['c_attn'\]"):
        tiny("model.lora.target_modules=[c_attn]")


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (["model.lora.target_modules=[embed_tokens]"], "model.embed_tokens is a Embedding"),
        (
            ["model.lora.target_modules=[q_proj,lm_head]", "model.tie_word_embeddings=true"],
            "lm_head's weight is tied to another",
        ),
    ],
    ids=["embedding", "tied_lm_head"],
)
def test_layers_that_cannot_train_as_linear_adapters_are_refused(overrides, refused):
    with pytest.raises(ConfigError, match="model.lora.target_modules=") as caught:
        tiny(*overrides)
    assert refused in str(caught.value)


def test_merged_weights_compute_what_the_adapted_model_computes():
    adapted = tiny()
    randomize_adapters(adapted, seed=1)
    merged_state = dict(merged_weights(adapted.state_dict().items(), LoraConfig(rank=4, alpha=8)))
    torch.manual_seed(0)
    plain = build_model(load_config(["cfg=configs/tiny_cpu.yaml"]).model)
    assert merged_state.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged_state)
    tokens = torch.randint(0, 256, (1, 16))
    expected = adapted(input_ids=tokens).logits
    assert (plain(input_ids=tokens).logits - expected).abs().max() < 1e-5


def test_the_adapter_is_named_as_peft_saves_it():
    names = list(adapter_state(tiny().state_dict().items()))
    assert len(names) == 28
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names


def test_another_checkpoint_copied_over_the_base_is_refused_by_its_fingerprint(tmp_path):
    base = tmp_path / "base"
    tiny().save_pretrained(base)
    shutil.copytree(base, tmp_path / "copy")
    assert base_fingerprint(str(base)) == base_fingerprint(str(tmp_path / "copy"))
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", *LORA, f"model.pretrained_path={base}"])
    before = run_settings(cfg, layout_for(cfg), 1)
    torch.manual_seed(7)  # another fine-tune of the same architecture
    build_model(load_config(["cfg=configs/tiny_cpu.yaml"]).model).save_pretrained(base)
    after = run_settings(cfg, layout_for(cfg), 1)
    identity, _ = refused(before, after)
    assert [d.key for d in identity] == ["model.base"]
    assert before["model.base"] != after["model.base"]


def test_a_full_fine_tune_records_no_base():
    cfg = load_config(["cfg=configs/tiny_cpu.yaml"])
    assert "model.base" not in run_settings(cfg, layout_for(cfg), 1)


def test_the_adapters_are_exported_when_the_merged_model_fails_and_every_weight_is_taken(
    tmp_path, monkeypatch
):
    """A full disk under hf/ loses the merged model, never the run's adapters; and the stream
    is taken to its end, as FSDP2's other ranks gather every tensor with rank 0."""
    adapted = tiny()
    state = adapted.state_dict()
    taken = []

    def weights():
        for name, tensor in state.items():
            taken.append(name)
            yield name, tensor

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "save_file", full_disk)
    lora = LoraConfig(rank=4, alpha=8, export_merged=True)
    with pytest.raises(OSError, match="No space left"):
        export.export_run(adapted, tmp_path, weights(), None, lora, "/base")
    assert taken == list(state)
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(saved) == 28 and not (tmp_path / "hf").exists()


def test_a_lora_run_without_a_merged_export_gathers_only_the_adapters():
    keep = export.exported_names(LoraConfig())
    names = list(tiny().state_dict())
    assert [n for n in names if keep(n)] == [n for n in names if ".lora_" in n]
    assert all(map(export.exported_names(None), names))
    assert all(map(export.exported_names(LoraConfig(export_merged=True)), names))
