"""data.documents=masked: samples carry the document ids of the prepared dataset's recorded
document ends, and a tiny_cpu run on them trains end to end and resumes bit for bit."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from submitit.core.utils import pickle_load

from slurm_autosp.config import ConfigError, DocumentBoundaries, load_config
from slurm_autosp.data import SyntheticSource, open_tokens, write_token_file
from slurm_autosp.data.prepared import SUMMARY, SplitFiles

REPO = Path(__file__).resolve().parents[1]
MASKED = DocumentBoundaries.masked


def prepared_dataset(root: Path, document_lengths: list[int], vocab_size: int = 256) -> Path:
    """A prepared directory as `prepare` writes it: tokens, document ends, summary (last)."""
    root.mkdir(parents=True, exist_ok=True)
    files = SplitFiles.of(root, "train")
    tokens = SyntheticSource(vocab_size, sum(document_lengths), seed=1).sample(0).input_ids
    write_token_file(files.tokens, tokens.numpy(), vocab_size)
    np.save(files.documents, np.cumsum(document_lengths).astype(np.uint64))
    summary = {"documents": len(document_lengths), "tokens": sum(document_lengths)}
    (root / SUMMARY).write_text(json.dumps(summary))
    return root


def test_samples_number_the_documents_they_cut_from_the_file(tmp_path):
    source = open_tokens(prepared_dataset(tmp_path / "d", [5, 3, 9, 7]), 8, 256, documents=MASKED)
    assert [source.sample(i).document_ids.tolist() for i in range(3)] == [
        [0, 0, 0, 0, 0, 1, 1, 1],  # a document ends exactly where the sample does
        [0, 0, 0, 0, 0, 0, 0, 0],  # inside one document: its middle is a document here
        [0, 1, 1, 1, 1, 1, 1, 1],  # a document's last token, then the next one
    ]
    concat = open_tokens(tmp_path / "d", 8, 256)
    assert concat.sample(0).document_ids is None


def test_masked_documents_need_recorded_document_ends_and_token_data(tmp_path):
    bare = tmp_path / "bare.tokens"
    write_token_file(bare, np.arange(64), 256)
    with pytest.raises(ValueError, match="bare token file records no document ends"):
        open_tokens(bare, 8, 256, documents=MASKED)
    with pytest.raises(ConfigError, match="data.documents=masked needs data.source=tokens"):
        load_config([f"cfg={REPO / 'configs' / 'tiny_cpu.yaml'}", "data.documents=masked"])


def _final_result(run_dir: Path):
    outcome, result = pickle_load(sorted((run_dir / "submitit").glob("*_0_result.pkl"))[-1])
    assert outcome == "success", result
    return result


def _submit(root: Path, name: str, data: Path, steps: int) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slurm_autosp.submit",
            "cfg=configs/tiny_cpu.yaml",
            "cluster.backend=local",
            "data.source=tokens",
            f"data.path={data}",
            "data.seq_len=128",
            "data.documents=masked",
            "train.lr_schedule=constant",  # the schedule must not depend on train.steps,
            "train.warmup_steps=0",  # which the resumed half raises from 3 to 6
            f"train.steps={steps}",
            f"run.output_root={root}",
            f"run.name={name}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_masked_tiny_cpu_run_trains_and_resumes_bit_for_bit(tmp_path):
    rng = np.random.default_rng(0)
    data = prepared_dataset(tmp_path / "data", rng.integers(1, 200, 64).tolist())
    _submit(tmp_path, "whole", data, steps=6)
    _submit(tmp_path, "halves", data, steps=3)
    _submit(tmp_path, "halves", data, steps=6)
    whole, resumed = _final_result(tmp_path / "whole"), _final_result(tmp_path / "halves")
    assert whole.losses[-1] < whole.losses[0], "the masked run learns"
    assert resumed.first_step == 3 and resumed.losses == whole.losses[3:]
    exported, reference = (
        load_file(tmp_path / n / "hf" / "model.safetensors") for n in ("halves", "whole")
    )
    assert all(torch.equal(exported[name], reference[name]) for name in reference)
