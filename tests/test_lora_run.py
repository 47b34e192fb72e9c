"""A LoRA fine-tune through the command, on local processes: a tiny pretrained Llama, packed
documents, SP=2 (its start check passed with the adapters). Its checkpoints hold the adapters
and their optimizer state, never the base; preempted, it resumes with the uninterrupted run's
losses under either engine; resubmitted on another base it is refused naming both; its
adapters load in PEFT on the base and generate, and its merged export loads in transformers and
computes what PEFT computes."""

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from reference_run import reference_cmd, tensorboard_losses
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slurm_autosp.config import load_config
from slurm_autosp.lora import base_fingerprint
from slurm_autosp.model import build_model

REPO = Path(__file__).resolve().parents[1]
STEPS = 20
LORA = ("model.lora={}", "model.lora.rank=4", "model.lora.alpha=8", "model.lora.export_merged=true")


def save_base(directory: Path, seed: int) -> Path:
    """A tiny Llama of the shipped config's shape, as save_pretrained writes it."""
    torch.manual_seed(seed)
    build_model(load_config(["cfg=configs/tiny_cpu.yaml"]).model).save_pretrained(directory)
    return directory


def lora_cmd(root: Path, name: str, base: Path, overrides: tuple[str, ...]) -> list[str]:
    """The reference run's submit (reference_run.reference_cmd) as a LoRA fine-tune of `base`:
    STEPS steps under ZeRO-1, unless `overrides` (given last) say otherwise."""
    lora = (
        f"model.pretrained_path={base}",
        "parallel.zero_stage=1",
        f"train.steps={STEPS}",
        "train.lr=1e-2",
        *LORA,
    )
    return reference_cmd(root, name, (*lora, *overrides))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_base(tmp_path_factory.mktemp("base") / "llama", seed=1)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base, reference_overrides) -> Path:
    """The uninterrupted LoRA run under ZeRO-1."""
    root = tmp_path_factory.mktemp("lora")
    done = subprocess.run(
        lora_cmd(root, "ref", base, reference_overrides),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "exactness check: passed" in done.stdout + done.stderr
    return root / "ref"


def last_losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss as the last start that ran it logged it."""
    return dict(tensorboard_losses(run_dir))


@pytest.mark.slow
def test_checkpoints_hold_the_adapters_and_no_base_weight_and_status_names_the_export(
    lora_run, base
):
    checkpoint = max((lora_run / "checkpoints").glob("step_*"))
    module = torch.load(checkpoint / "engine" / "module.pt", weights_only=True)
    assert module and all(".lora_" in name for name in module), sorted(module)
    assert not any(name.endswith(".base_layer.weight") for name in module)
    held = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    assert held < (base / "model.safetensors").stat().st_size, held
    status = subprocess.run(
        [sys.executable, "-m", "slurm_autosp", "status", str(lora_run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"LoRA adapters (PEFT's format, on model.pretrained_path): {lora_run / 'adapter'}" in (
        status.stdout
    ), status.stdout + status.stderr


@pytest.mark.slow
def test_the_adapters_load_in_peft_and_generate_and_the_merged_export_computes_the_same(
    lora_run, base
):
    adapters = load_file(lora_run / "adapter" / "adapter_model.safetensors")
    assert adapters and all(
        name.startswith("base_model.model.") and ".lora_" in name for name in adapters
    )
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), lora_run / "adapter"
    )
    merged = AutoModelForCausalLM.from_pretrained(lora_run / "hf")
    untuned = AutoModelForCausalLM.from_pretrained(base)
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = tuned(input_ids=tokens).logits
        assert (logits - merged(input_ids=tokens).logits).abs().max() < 1e-4
        assert (logits - untuned(input_ids=tokens).logits).abs().max() > 1e-3  # it trained
    generated = tuned.generate(tokens, max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, 32)
    assert torch.equal(generated, merged.generate(tokens, max_new_tokens=8, do_sample=False))


def signalled_once(cmd: list[str], folder: Path) -> str:
    """Submit; send USR2 to the job's processes once rank 0 logged step 3. Returns the output
    of the whole run (the stop, the requeue and the resumed start)."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    lines, signalled = [], False
    for line in proc.stdout:
        lines.append(line)
        if not signalled and re.search(rf" step 3/{STEPS} ", line):
            pattern = f"submitit.core._submit {folder}"
            subprocess.run(["pkill", f"-{signal.SIGUSR2.name}", "-f", pattern], check=True)
            signalled = True
    proc.wait(timeout=600)
    output = "".join(lines)
    assert proc.returncode == 0 and signalled, output[-4000:]
    return output


LADDER = (
    "compile.activation_checkpointing=sac",
    "compile.tile_tokens=48",
    "compile.offload_activations=true",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("zero_stage", "ladder"), [(1, ()), (3, LADDER)], ids=["zero1", "fsdp2_tiled_offloaded"]
)
def test_a_preempted_lora_job_resumes_with_the_uninterrupted_losses(
    tmp_path, lora_run, base, reference_overrides, zero_stage, ladder
):
    """ZeRO-1 resumes bit for bit. FSDP2 (its own reductions), with the adapted MLPs in
    sequence tiles recomputed tile by tile and what backward keeps in host memory, trains the
    same losses within fp32 rounding."""
    overrides = (*reference_overrides, f"parallel.zero_stage={zero_stage}", *ladder)
    folder = tmp_path / "resumed" / "submitit"
    output = signalled_once(lora_cmd(tmp_path, "resumed", base, overrides), folder)
    assert "stopping at step" in output and "resumed from" in output, output[-4000:]
    assert ("activation offload" in output) == bool(ladder)
    losses, reference = last_losses(tmp_path / "resumed"), last_losses(lora_run)
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 1))
    if zero_stage == 1:
        assert losses == reference
        ours = load_file(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors")
        theirs = load_file(lora_run / "adapter" / "adapter_model.safetensors")
        assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    else:
        assert all(abs(losses[s] - reference[s]) <= 1e-5 * reference[s] for s in reference), (
            losses,
            reference,
        )


@pytest.mark.slow
def test_a_resubmission_on_another_base_is_refused_naming_both(
    tmp_path, lora_run, reference_overrides
):
    """Refused before anything is queued, naming the path and the base's fingerprint in the
    checkpoint and now (tests/test_lora.py: another checkpoint copied over the same path)."""
    other = save_base(tmp_path / "other", seed=2)
    root = lora_run.parent
    more = (*reference_overrides, f"train.steps={STEPS + 4}")
    done = subprocess.run(
        lora_cmd(root, "ref", other, more), cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "model.pretrained_path" in done.stderr and "model.base" in done.stderr, done.stderr
    assert base_fingerprint(str(other)) in done.stderr
