"""docs/finetune.md's commands, run exactly as the page writes them: its `bash` blocks, in
order, with the names of its settings block pointing at a tiny chat checkpoint, generated chats
and the tiny config on local CPU ranks. A command of the page that stops working fails here."""

import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from runbook import fenced, run_blocks
from slurm_helpers import REPO
from test_chat_masks import CHATML, with_template
from test_chat_masks import base_tokenizer as base_tokenizer  # the fixture
from test_data_prepare import conversation, write_jsonl
from transformers import AutoTokenizer

from slurm_autosp.config import ModelConfig
from slurm_autosp.model import build_model

PAGE = REPO / "docs" / "finetune.md"


def tiny_checkpoint(base_tokenizer: Path, directory: Path) -> Path:
    """What `save_pretrained` writes for a chat model: a seeded tiny Llama and a ChatML
    tokenizer in one directory, as a downloaded checkpoint holds them."""
    with_template(base_tokenizer, directory, CHATML)
    torch.manual_seed(0)
    vocab = len(AutoTokenizer.from_pretrained(directory))
    build_model(ModelConfig(vocab_size=vocab)).save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_the_finetune_runbook_runs_from_chats_to_a_generated_reply(tmp_path, base_tokenizer):
    config = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    config["cluster"]["backend"] = "local"  # never a Slurm another test started
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "chats").mkdir()
    rows = [{"messages": conversation(i)} for i in range(200)]
    write_jsonl(tmp_path / "chats" / "part0.jsonl", rows)
    names = {
        "MODEL": str(tiny_checkpoint(base_tokenizer, tmp_path / "model")),
        "CHATS": str(tmp_path / "chats" / "*.jsonl"),
        "DATA": str(tmp_path / "data"),
        "CONFIG": str(tmp_path / "cluster.yaml"),
        "RUNS": str(tmp_path / "runs"),
        "STEPS": "4",
        "EVAL_EVERY": "2",
    }
    settings = next(block for block in fenced(PAGE, "sh") if "MODEL=" in block)
    assert set(re.findall(r"^([A-Z_]+)=", settings, re.M)) == set(names)

    commands = fenced(PAGE, "bash")
    assert len(commands) >= 5, "the page's runnable blocks are fenced as ```bash"
    env = {**os.environ, **names}
    outputs = run_blocks(commands, env)

    everything = "".join(outputs)
    assert "eval at step 2 | loss" in everything and "eval at step 4 | loss" in everything
    assert "held-out evaluation" in everything  # the summary's table
    assert "model.safetensors" in everything and "chat_template.jinja" in everything
    assert "adapter_model.safetensors" in everything and "adapter_config.json" in everything
    assert outputs[-1].strip(), "the LoRA adapters generated no reply"
    print("reply:", outputs[-1].strip())
