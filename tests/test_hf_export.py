"""The Hugging Face export of a run on prepared data: generation stops where the data's turns
end, and every file is readable like the rest."""

import json
import os
import stat

import pytest
from test_chat_masks import CHATML, with_template
from test_chat_masks import base_tokenizer as base_tokenizer  # the fixture
from test_data_prepare import conversation, prepare, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from slurm_autosp.checkpoint.export import export_hf
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
