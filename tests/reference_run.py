"""The uninterrupted local reference run that resumed runs (local and on Slurm) must match bit
for bit; tests/conftest.py's `uninterrupted_run` fixture trains it once per session.

FSDP2 (parallel.zero_stage=3), on a prepared directory read in a seeded shuffled order, with
per-document attention (data.documents=masked, documents of 1 to 400 tokens): 50 samples of
256 tokens, 2 a step, so an epoch is 25 steps and the 100 steps run into a fourth epoch, each
in its own order. A run stopped in its first epoch must read, after the resume, what this one
read. ZeRO-1's resume is tested at the engine level (tests/test_checkpoint_store.py,
tests/compile/test_optimizer_offload_steps.py) and through a resubmitted job
(tests/resubmitted_run.py)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from slurm_autosp.data import SyntheticSource, write_token_file
from slurm_autosp.data.prepared import SUMMARY, SplitFiles

REPO = Path(__file__).resolve().parents[1]
REFERENCE_STEPS = 100
REFERENCE_SAMPLES = 50
SAMPLES_PER_STEP = 2
REFERENCE_TRAINING = (
    f"train.steps={REFERENCE_STEPS}",
    "train.log_every=1",
    "parallel.zero_stage=3",
)
REFERENCE_ARGS = ("cfg=configs/tiny_cpu.yaml", *REFERENCE_TRAINING)


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


def reference_data(folder: Path) -> tuple[str, ...]:
    """Write the reference's prepared directory into `folder`; returns the overrides that read
    it."""
    lengths = np.random.default_rng(0).integers(1, 400, REFERENCE_SAMPLES * 256).cumsum()
    ends = [*lengths[lengths < REFERENCE_SAMPLES * 256].tolist(), REFERENCE_SAMPLES * 256]
    data = prepared_dataset(folder / "prepared", np.diff(ends, prepend=0).tolist())
    return (
        "data.source=tokens",
        f"data.path={data}",
        "data.shuffle=true",
        "data.documents=masked",
    )


def reference_cmd(root: Path, name: str, overrides: tuple[str, ...] = ()) -> list[str]:
    """submit of the reference's training on local processes into root/name."""
    return [
        sys.executable,
        "-m",
        "slurm_autosp.submit",
        *REFERENCE_ARGS,
        "cluster.backend=local",
        f"run.output_root={root}",
        f"run.name={name}",
        *overrides,
    ]


def train_reference(root: Path, overrides: tuple[str, ...] = ()) -> Path:
    """Train the reference (with `overrides`) into root/ref; returns the run directory."""
    proc = subprocess.run(
        reference_cmd(root, "ref", overrides), cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    return root / "ref"


def tensorboard_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) as the run's TensorBoard files hold them, every attempt's steps together."""
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


def run_text(run_dir: Path, tag: str) -> str:
    """Every start's TensorBoard text of `tag`, joined."""
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    return "\n".join(e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag))


def hf_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The run's exported Hugging Face weights."""
    return load_file(run_dir / "hf" / "model.safetensors")


def assert_same_weights(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]):
    """Bit for bit."""
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[name], reference[name]) for name in weights)
