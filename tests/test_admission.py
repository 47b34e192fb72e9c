"""One admission path: submit, the probe (through submit) and a hand-submitted rank (`run`)
refuse a bad config with admission's own message, before anything is written; `plan` and
`verify` refuse with its model stage and leave the queueing checks to submit; a requeued
start adopts what its first start froze and is not refused by a plan that changed."""

from pathlib import Path

import pytest
from first_start import FROZEN, record_first_start
from in_process import run_command
from reference_run import prepared_dataset
from transformers import LlamaConfig

import slurm_autosp.memory_plan.choose as choose
from slurm_autosp.admission import admit, admit_model
from slurm_autosp.commands.plan import main as plan_main
from slurm_autosp.commands.probe import main as probe_main
from slurm_autosp.commands.run import admit_start
from slurm_autosp.commands.run import main as run_main
from slurm_autosp.commands.submit import main as submit_main
from slurm_autosp.commands.verify import main as verify_main
from slurm_autosp.config import ConfigError, load_config

TINY = "cfg=configs/tiny_cpu.yaml"
LLAMA8B = "cfg=configs/llama8b_32k.yaml"


def bad_config(case: str, tmp_path: Path) -> list[str]:
    """A config refused by one stage of admission: the model, the data, the layout."""
    if case == "attention":
        return [TINY, "model.model_type=llama4_text", "model.extra.attention_chunk_size=16"]
    if case == "data":
        junk = tmp_path / "tokens.bin"
        junk.write_text("not tokens")
        return [TINY, "data.source=tokens", f"data.path={junk}"]
    # Ulysses alone beyond an NVLink domain
    return ["cfg=configs/llama70b_128k.yaml", "parallel.sp_size=16", "parallel.ring_size=1"]


def admission_refusal(args: list[str]) -> str:
    with pytest.raises(ConfigError) as refused:
        admit(load_config(args))
    return str(refused.value)


@pytest.mark.parametrize("case", ["attention", "data", "layout"])
@pytest.mark.parametrize(
    "main", [submit_main, probe_main, run_main], ids=["submit", "probe", "run"]
)
def test_every_queueing_command_refuses_with_admissions_message(case, main, tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)  # run sets it; restored after
    runs = tmp_path / "runs"
    args = [*bad_config(case, tmp_path), f"run.output_root={runs}"]
    expected = admission_refusal(args)
    proc = run_command(main, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {expected}\n" in proc.stderr, proc.stderr
    assert not runs.exists(), "nothing may be written for a refused job"


@pytest.mark.parametrize("main", [plan_main, verify_main], ids=["plan", "verify"])
def test_plan_and_verify_refuse_a_model_with_admissions_message(main, tmp_path):
    args = bad_config("attention", tmp_path)
    proc = run_command(main, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {admission_refusal(args)}\n" in proc.stderr, proc.stderr


def test_plan_answers_whether_a_job_fits_leaving_its_data_to_submit(tmp_path):
    args = bad_config("data", tmp_path)
    admission_refusal(args)  # submit refuses it
    proc = run_command(plan_main, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: fits" in proc.stdout


def test_a_requeued_start_adopts_its_frozen_choices_where_a_first_start_is_refused(
    tmp_path, monkeypatch
):
    """The GPUs shrank since the first start (a plan that changed): a first start is refused
    as submit would refuse it; a requeue trains with what was frozen, planning nothing."""
    shrunk = [LLAMA8B, f"run.output_root={tmp_path}", "cluster.gpu_memory_gb=1"]
    with pytest.raises(ConfigError, match="the job does not fit its GPUs") as refused:
        admit_start(load_config(shrunk), restarted=False)
    first_start = admit(load_config(shrunk))
    with pytest.raises(ConfigError) as submitted:
        first_start.refuse_unless_fits()
    assert str(refused.value) == str(submitted.value)

    record_first_start(LLAMA8B, tmp_path)

    def planned_again(cfg):
        raise AssertionError("planned again")

    monkeypatch.setattr(choose, "build_plan", planned_again)
    requeued = admit_start(load_config(shrunk), restarted=True)
    assert requeued.plan.fits and requeued.plan.choices == FROZEN
    assert (requeued.cfg.parallel.zero_stage, requeued.cfg.compile.tile_tokens) == (3, 1024)


@pytest.mark.parametrize("pattern", ["sliding window", "packed documents"])
def test_a_ring_is_admitted_for_windows_and_packed_documents(pattern, tmp_path):
    """Ring attention computes both (tests/compile/test_ring_attention.py): nothing refused."""
    if pattern == "sliding window":
        args = [TINY, "model.model_type=mistral", "model.extra.sliding_window=16"]
    else:
        data = prepared_dataset(tmp_path / "prepared", [100, 156, 256])
        args = [TINY, "data.source=tokens", f"data.path={data}", "data.documents=masked"]
    admit_model(load_config([*args, "parallel.ring_size=2"]))  # raises ConfigError if refused


def test_admission_writes_the_ring_size_into_the_config_and_a_requeue_adopts_its_own(tmp_path):
    """A null ring size is resolved once, at admission, into the config every rank trains
    with; a requeue keeps what its first start resolved (a frozen key)."""
    args = [TINY, "cluster.tasks_per_node=8", "parallel.sp_size=8", f"run.output_root={tmp_path}"]
    first = admit(load_config(args))  # 4 heads: Ulysses 4 inside the node's 8 ranks, ring 2
    assert first.cfg.parallel.ring_size == 2 and first.layout.ring_size == 2
    recorded = load_config([*args, "parallel.ring_size=4"])
    requeued = admit(load_config(args), recorded=recorded)
    assert requeued.cfg.parallel.ring_size == 4 and requeued.layout.ulysses_size == 2


def test_a_checkpoints_own_heads_resolve_the_ring_and_refuse_a_ulysses_size(tmp_path):
    """A checkpoint's own heads (6 query, 3 key/value), not the config's shape fields, resolve
    a null ring size and refuse a Ulysses size they cannot split, with the splits that work."""
    LlamaConfig(
        hidden_size=48, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=1
    ).save_pretrained(tmp_path)
    args = [TINY, f"model.pretrained_path={tmp_path}", "cluster.tasks_per_node=4"]
    resolved = load_config([*args, "parallel.sp_size=4"])
    assert resolved.parallel.ulysses_ring == (1, 4)
    admit_model(resolved)
    with pytest.raises(ConfigError) as refused:
        load_config([*args, "parallel.sp_size=4", "parallel.ring_size=1"])
    assert (
        "parallel.sp_size=4 / parallel.ring_size=1: the Ulysses size 4 cannot split "
        f"num_attention_heads=6 / num_key_value_heads=3 of model.pretrained_path={tmp_path} over "
        "its ranks (Ulysses sizes the heads allow: 1, 3 or 6); (Ulysses x ring) splits of "
        "parallel.sp_size=4 that work: 1 x 4 (parallel.ring_size=4)"
    ) in str(refused.value)


def test_eager_attention_under_autosp_is_refused_before_any_rank_starts(tmp_path):
    """AutoSP rewrites sdpa calls only: eager would fail on every rank after the queue wait."""
    runs = tmp_path / "runs"
    eager = [TINY, "model.attn_implementation=eager", f"run.output_root={runs}"]
    refusal = admission_refusal(eager)
    assert "model.attn_implementation=eager: AutoSP rewrites" in refusal, refusal
    assert "set model.attn_implementation=sdpa" in refusal, refusal
    proc = run_command(submit_main, *eager)
    assert proc.returncode == 2 and f"error: {refusal}\n" in proc.stderr, proc.stderr
    assert not runs.exists()
    # without AutoSP eager attention is the model's own, and trains
    admit_model(load_config([*eager, "compile.enabled=false", "parallel.sp_size=1"]))
