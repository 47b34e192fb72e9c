"""The Hugging Face export of a run on prepared data: generation stops where the data's turns
end, and every file is readable like the rest; the weights stream into shards."""

import json
import os
import stat
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_chat_masks import CHATML, with_template
from test_chat_masks import base_tokenizer as base_tokenizer  # the fixture
from test_data_prepare import conversation, prepare, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from slurm_autosp.checkpoint.export import distinct_tensors, export_hf
from slurm_autosp.config import ModelConfig
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.model import build_model


@pytest.fixture
def chat_data(tmp_path, base_tokenizer):
    tok_dir = with_template(base_tokenizer, tmp_path / "tok", CHATML)
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(i)} for i in range(3)])
    assert prepare(tok_dir, [corpus], tmp_path / "data", "--format", "chat") == 0
    return tmp_path / "data"


def test_the_export_of_a_chat_run_stops_generating_at_the_end_of_a_turn(tmp_path, chat_data):
    export_hf(build_model(ModelConfig(vocab_size=320)), tmp_path / "run", None, chat_data / "tokenizer")  # fmt: skip
    hf = RunDir(tmp_path / "run").hf_export
    tokenizer = AutoTokenizer.from_pretrained(hf)
    end_of_turn, eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<eos>"])
    assert json.loads((hf / "config.json").read_text())["eos_token_id"] == end_of_turn
    assert AutoModelForCausalLM.from_pretrained(hf).config.eos_token_id == end_of_turn
    assert GenerationConfig.from_pretrained(hf).eos_token_id == [end_of_turn, eos]


def test_data_prepared_before_the_end_of_turn_was_recorded_stops_at_eos(tmp_path, chat_data):
    summary = json.loads((chat_data / "summary.json").read_text())
    del summary["end_of_turn_token_id"]
    (chat_data / "summary.json").write_text(json.dumps(summary))
    export_hf(build_model(ModelConfig(vocab_size=320)), tmp_path / "run", None, chat_data / "tokenizer")  # fmt: skip
    hf = RunDir(tmp_path / "run").hf_export
    eos = summary["eos_token_id"]
    assert json.loads((hf / "config.json").read_text())["eos_token_id"] == eos
    assert GenerationConfig.from_pretrained(hf).eos_token_id == [eos]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_exported_file_has_the_mode_the_umask_gives(tmp_path, chat_data, umask):
    """safetensors writes the weights through a temporary file of mode 0600."""
    previous = os.umask(umask)
    try:
        export_hf(build_model(ModelConfig(vocab_size=320)), tmp_path / "run", None, chat_data / "tokenizer")  # fmt: skip
    finally:
        os.umask(previous)
    modes = {
        p.name: oct(stat.S_IMODE(p.stat().st_mode))
        for p in RunDir(tmp_path / "run").hf_export.iterdir()
    }
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


class TrackedStream:
    """The whole model's tensors one at a time, each a copy of its own (as FSDP2 gathers one,
    or ZeRO-1 copies one from the GPU), with the bytes of those still alive counted through
    their finalizers: what the export holds when it asks for the next tensor is `held`."""

    def __init__(self, model):
        self.model = model
        self.alive = 0
        self.held: list[int] = []  # alive bytes each time the export takes the next tensor

    def __iter__(self):
        for name, tensor in distinct_tensors(self.model):
            self.held.append(self.alive)
            copy = tensor.detach().clone()
            size = copy.numel() * copy.element_size()
            self.alive += size
            weakref.finalize(copy, self._freed, size)
            yield name, copy

    def _freed(self, size: int) -> None:
        self.alive -= size


def test_the_export_streams_shards_that_load_with_the_models_logits_holding_one_shard(tmp_path):
    """A tied tiny Llama (0.36 MB in fp32) in shards of at most 100 kB: four files and their
    index as save_pretrained names them, the same tensors and config it writes (the tied head
    once), the same logits loaded back; never more than one shard's tensors held."""
    model = build_model(ModelConfig(tie_word_embeddings=True))
    stream = TrackedStream(model)
    export_hf(model, tmp_path / "run", stream, max_shard_bytes=100_000)
    hf = RunDir(tmp_path / "run").hf_export
    shards = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(p.name for p in hf.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json", *shards]
    )
    assert max(stream.held) <= 100_000 < sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    assert stream.alive == 0  # nothing kept once written

    model.save_pretrained(tmp_path / "hf_saved", max_shard_size="100KB")
    saved = tmp_path / "hf_saved"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert index == json.loads((saved / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as HF writes it
    for file in set(index["weight_map"].values()):
        with safe_open(hf / file, "pt") as shard:
            assert sum(shard.get_tensor(k).nbytes for k in shard.keys()) <= 100_000
            assert shard.metadata() == {"format": "pt"}
    exported = {k: v for f in hf.glob("*.safetensors") for k, v in load_file(f).items()}
    written = {k: v for f in saved.glob("*.safetensors") for k, v in load_file(f).items()}
    assert exported.keys() == written.keys()
    assert all(torch.equal(exported[k], written[k]) for k in written)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((hf / name).read_text()) == json.loads((saved / name).read_text())

    loaded = AutoModelForCausalLM.from_pretrained(hf)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
