"""Checkpoints are atomic: a broken or half-written one is skipped and the last good one used;
under both engines (DeepSpeed ZeRO-1 and FSDP2 parameter sharding, one rank each)."""

import dataclasses
import json
import os
import random
import shutil

import pytest
import torch
from reference_run import prepared_dataset
from saved_on_device import saved_on

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from slurm_autosp.checkpoint.identity import run_settings  # noqa: E402
from slurm_autosp.checkpoint.manifest import (  # noqa: E402
    FileRecord,
    hash_files,
    list_files,
    read_manifest,
    write_manifest,
)
from slurm_autosp.checkpoint.store import (  # noqa: E402
    DAMAGE_NOTE,
    TRAINER_STATE,
    CheckpointError,
    CheckpointStore,
    TrainerState,
    cuda_rng_state,
    damage_report,
    damaged_checkpoints,
    refuse_another_runs_checkpoint,
)
from slurm_autosp.cluster.placement import layout_for  # noqa: E402
from slurm_autosp.config import ConfigError, load_config  # noqa: E402
from slurm_autosp.data.prepared import SUMMARY  # noqa: E402
from slurm_autosp.engine import build_engine  # noqa: E402
from slurm_autosp.optim import lr_factor  # noqa: E402

STAGES = {"deepspeed_zero1": 1, "fsdp2": 3}


def job_config(zero_stage, *overrides):
    return load_config(
        ["cluster.tasks_per_node=1", f"parallel.zero_stage={zero_stage}", *overrides]
    )


# FSDP2's cases in the slow tier: the fast tier keeps its 5 minutes with ZeRO-1's
@pytest.fixture(params=[1, pytest.param(3, marks=pytest.mark.slow)], ids=["zero1", "fsdp2"])
def engine(request, single_rank_group):
    torch.manual_seed(0)
    return build_engine(job_config(request.param), torch.device("cpu"), request.param)


def settings(engine_name, *overrides):
    """What a job of this engine with these overrides records and resumes with."""
    cfg = job_config(STAGES[engine_name], *overrides)
    return run_settings(cfg, layout_for(cfg), STAGES[engine_name])


def state(step, engine_name, samples_per_step=1):
    """A checkpoint's trainer state, written by the fixture's job (its global batch is 1)."""
    written = settings(engine_name)
    return TrainerState(
        step=step,
        samples_consumed=step * samples_per_step,
        world_size=1,
        layout=written["parallel.layout"],
        engine=engine_name,
        settings=written,
    )


def rewrite_as_before_settings(checkpoint, **changes):
    """Make `checkpoint` look written by a version that recorded an opaque config hash instead of
    its settings (and these other `changes`), its manifest updated to match."""
    old = {
        k: v
        for k, v in json.loads((checkpoint / TRAINER_STATE).read_text()).items()
        if k != "settings"
    }
    (checkpoint / TRAINER_STATE).write_text(
        json.dumps({**old, "config_hash": "0123456789abcdef", **changes})
    )
    manifest = read_manifest(checkpoint)
    records = {name: FileRecord(**r) for name, r in manifest["files"].items()}
    records.update(hash_files(checkpoint, [TRAINER_STATE], fsync=False))
    write_manifest(checkpoint, records, manifest["meta"])


def params(engine):
    """Copies: on one rank an FSDP2 parameter's full_tensor() is the parameter's own storage."""
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in engine.module.parameters()
    ]


def perturb(engine):
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)


def test_saved_checkpoint_restores_weights_and_trainer_state(tmp_path, engine):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    before = params(engine)
    store.save(engine, state(3, engine.name))
    perturb(engine)
    resumed = store.load_latest(engine, settings(engine.name))
    assert resumed == state(3, engine.name)
    assert all(torch.equal(a, b) for a, b in zip(before, params(engine), strict=True))
    assert (tmp_path / "latest").read_text() == "step_00000003"


def test_a_checkpoint_a_gpu_saved_synchronously_resumes_on_the_host(tmp_path, engine):
    """A synchronous save on a GPU recorded each tensor's device (fused AdamW's step lives on its
    GPU), and the resume loaded the optimizer's and schedule's files without map_location: on
    the GPU that wrote them, from every rank (here, without a GPU, not at all)."""
    logits = engine(input_ids=torch.ones(1, 8, dtype=torch.long)).logits
    engine.backward(logits.float().square().mean() * engine.loss_scale)
    engine.step()
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    before = params(engine)
    checkpoint = store.save(engine, state(1, engine.name))
    written = list_files(checkpoint)
    for name in written:  # the engine's torch.save files (the RNG states are host tensors)
        if name.startswith("engine/") and name.endswith(".pt"):
            tree = torch.load(checkpoint / name, weights_only=True)
            with saved_on("cuda:0"):
                torch.save(tree, checkpoint / name)
    manifest = read_manifest(checkpoint)
    write_manifest(checkpoint, hash_files(checkpoint, written, fsync=False), manifest["meta"])
    perturb(engine)
    assert store.load_latest(engine, settings(engine.name)) == state(1, engine.name)
    assert all(torch.equal(a, b) for a, b in zip(before, params(engine), strict=True))


def test_a_fenced_job_saves_commits_and_removes_nothing(tmp_path, engine):
    """Once another start of the job holds the run, a save is refused before it begins, and one
    already written is neither committed nor removed."""
    fenced = ""
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2, fence=lambda: fenced)
    store.save(engine, state(1, engine.name))
    partial, final = store.begin(state(2, engine.name))
    store.state_files(engine, state(2, engine.name)).write(partial)
    fenced = "a later start trains the run now"
    with pytest.raises(CheckpointError, match="not saving step 3: a later start trains the run"):
        store.save(engine, state(3, engine.name))
    with pytest.raises(CheckpointError, match="not committing step 2"):
        store.finish(partial, final, {}, state(2, engine.name))
    with pytest.raises(CheckpointError, match="not removing"):
        store.abandon(partial)
    assert partial.is_dir() and not final.exists()
    assert not (tmp_path / ".step_00000003.partial").exists()
    assert (tmp_path / "latest").read_text() == "step_00000001"


def test_retention_keeps_the_newest_k(tmp_path, engine):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    for step in (1, 2, 3):
        store.save(engine, state(step, engine.name))
    assert [p.name for p in store.checkpoints()] == ["step_00000003", "step_00000002"]


def test_save_that_dies_half_way_leaves_the_previous_checkpoint_in_use(
    tmp_path, engine, monkeypatch
):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(1, engine.name))
    good = params(engine)
    perturb(engine)

    def die(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", die)  # the first file of the engine's state
    with pytest.raises(OSError, match="No space left"):
        store.save(engine, state(2, engine.name))
    monkeypatch.undo()
    assert (tmp_path / ".step_00000002.partial").is_dir()
    assert store.load_latest(engine, settings(engine.name)) == state(1, engine.name)
    assert all(torch.equal(a, b) for a, b in zip(good, params(engine), strict=True))


def test_corrupt_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, engine, caplog):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=3)
    store.save(engine, state(1, engine.name))
    perturb(engine)
    store.save(engine, state(2, engine.name))
    newest = tmp_path / "step_00000002"
    manifest = json.loads((newest / "manifest.json").read_text())
    victim = newest / sorted(manifest["files"])[0]
    victim.write_bytes(victim.read_bytes()[:-10])
    with caplog.at_level("WARNING"):
        assert store.load_latest(engine, settings(engine.name)) == state(1, engine.name)
    assert "skipping checkpoint" in caplog.text and "step_00000002" in caplog.text


def test_checkpoint_without_manifest_is_never_used(tmp_path, engine):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=3)
    store.save(engine, state(1, engine.name))
    store.save(engine, state(2, engine.name))
    (tmp_path / "step_00000002" / "manifest.json").unlink()
    assert store.load_latest(engine, settings(engine.name)) == state(1, engine.name)


# SP=2 x DP=2 (compiled: AutoSP), one sample a micro-batch: global batch 2
FOUR_RANKS = ("cluster.tasks_per_node=4", "parallel.sp_size=2", "compile.enabled=true")


def test_another_world_size_and_layout_resume_at_the_same_global_batch_and_are_logged(
    tmp_path, engine, caplog
):
    """Written by 4 ranks as SP=2 x DP=2, resumed by this one-rank job with grad_accum 2 (the
    engines' formats reshard: tests/compile/test_reshard.py); the RNG state is rank 0's."""
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    written = settings(engine.name, *FOUR_RANKS)
    saved = TrainerState(2, 4, 4, written["parallel.layout"], engine.name, written)
    random.seed(5)
    store.save(engine, saved)
    expected = random.random()
    random.seed(9)
    with caplog.at_level("INFO"):
        assert store.load_latest(engine, settings(engine.name, "train.grad_accum=2")) == saved
    assert random.random() == expected
    for change in [
        "resuming with changed settings: cluster.tasks_per_node 4 -> 1; cluster.world_size 4 -> 1;",
        "; parallel.layout ParallelLayout(world_size 4 = sp 2 x dp 2;",
        "; parallel.sp_size 2 -> 1; train.grad_accum 1 -> 2",
    ]:
        assert change in caplog.text
    assert "resuming on another layout: checkpoint" in caplog.text


def test_another_global_batch_is_refused_naming_what_changed_it(tmp_path, engine):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    written = settings(engine.name, *FOUR_RANKS)
    store.save(engine, TrainerState(2, 4, 4, written["parallel.layout"], engine.name, written))
    with pytest.raises(CheckpointError) as refused:
        store.load_latest(engine, settings(engine.name))
    message = str(refused.value)
    for line in [
        "cluster.world_size: 4 in the checkpoint, 1 now (set by cluster.nodes x ranks per node)",
        "parallel.sp_size: 2 in the checkpoint, 1 now",
        "train.global_batch: 2 in the checkpoint, 1 now (set by train.micro_batch x train.grad_accum",
    ]:
        assert line in message
    assert "train.grad_accum:" not in message  # unchanged: not what changed the global batch
    assert "(parallel.sp_size=2)" in message


def test_another_layout_is_refused_to_a_model_with_dropout_naming_it(tmp_path, single_rank_group):
    """Each rank draws its dropout masks over its own rows and shard: another layout would not
    take the run's steps. On its own layout the run resumes (each rank its own RNG state)."""
    torch.manual_seed(0)
    dropout = ("model.extra={attention_dropout: 0.1}",)
    engine = build_engine(job_config(1, *dropout), torch.device("cpu"), 1)
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    written = settings(engine.name, *FOUR_RANKS, *dropout)
    store.save(engine, TrainerState(2, 4, 4, written["parallel.layout"], engine.name, written))
    with pytest.raises(CheckpointError, match=r"trains with dropout \(attention_dropout=0\.1\)"):
        store.load_latest(engine, settings(engine.name, "train.grad_accum=2", *dropout))
    own = settings(engine.name, *dropout)
    store.save(engine, TrainerState(3, 3, 1, own["parallel.layout"], engine.name, own))
    assert store.load_latest(engine, own).step == 3


def test_a_zero1_checkpoint_in_deepspeeds_own_format_resumes_on_as_many_ranks_only(
    tmp_path, single_rank_group, monkeypatch
):
    """Written by DeepSpeed's save_checkpoint, before engine.zero1_checkpoint's format: it
    resumes as before on the world size that wrote it, and another is refused naming both."""
    torch.manual_seed(0)
    engine = build_engine(job_config(1), torch.device("cpu"), 1)
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    before = params(engine)
    store.save(engine, state(1, engine.name))
    checkpoint = tmp_path / "step_00000001"
    shutil.rmtree(checkpoint / "engine")  # the engine's state in DeepSpeed's format instead
    engine._engine.save_checkpoint(str(checkpoint), tag="engine", save_latest=False)
    manifest = read_manifest(checkpoint)
    write_manifest(
        checkpoint, hash_files(checkpoint, list_files(checkpoint), False), manifest["meta"]
    )
    perturb(engine)
    assert store.load_latest(engine, settings(engine.name)) == state(1, engine.name)
    assert all(torch.equal(a, b) for a, b in zip(before, params(engine), strict=True))
    saved = tmp_path / "step_00000001" / "engine"
    (optimizer,) = saved.glob("*optim_states.pt")
    shutil.copy(optimizer, saved / optimizer.name.replace("rank_0_", "rank_1_"))  # as 2 ranks write
    with pytest.raises(
        CheckpointError, match="by 2 ranks, and loads on 2 ranks only; this job has 1"
    ):
        engine.load(saved)


def test_checkpoint_from_another_engine_is_refused(tmp_path, engine):
    """Checkpoints that record their settings are refused by parallel.zero_stage; older ones by their engine."""
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(1, engine.name))
    rewrite_as_before_settings(tmp_path / "step_00000001", engine="another_engine")
    with pytest.raises(
        CheckpointError,
        match=f"written by the another_engine engine but this job uses {engine.name}",
    ):
        store.load_latest(engine, settings(engine.name))


def test_unwritable_checkpoint_directory_is_reported_before_training(tmp_path, single_rank_group):
    blocker = tmp_path / "checkpoints"
    blocker.write_text("a file where the directory should be")
    store = CheckpointStore(blocker, rank=0, world_size=1, keep=2)
    with pytest.raises(
        CheckpointError, match=r"checkpoint directory .*checkpoints is not writable"
    ):
        store.check_writable()


def damage(checkpoint):
    """Cut ten bytes off one of the checkpoint's files, as a failing disk or a killed copy would."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    victim = checkpoint / sorted(manifest["files"])[0]
    victim.write_bytes(victim.read_bytes()[:-10])
    return victim


def test_retention_counts_only_verified_checkpoints_and_sets_the_damaged_one_aside(
    tmp_path, engine
):
    """Newest damaged, resumed from the one before: the next save keeps that good one (keep=2),
    and the damaged one is moved aside, never deleted."""
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    for step in (1, 2, 3):
        store.save(engine, state(step, engine.name))
    damage(tmp_path / "step_00000003")
    resumed = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    assert resumed.load_latest(engine, settings(engine.name)) == state(2, engine.name)
    resumed.save(engine, state(4, engine.name))
    assert [p.name for p in resumed.checkpoints()] == ["step_00000004", "step_00000002"]
    assert [p.name for p in damaged_checkpoints(tmp_path)] == ["damaged_step_00000003"]


def test_a_damaged_newest_checkpoint_never_costs_a_good_one(tmp_path, engine, caplog):
    """Save 5 and 10, damage 10, resume (from 5), write 10 again, resubmit: the run resumes at
    the new 10, the damaged 10 is kept aside with what was wrong, and 5 is still there."""
    first = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    first.save(engine, state(5, engine.name))
    first.save(engine, state(10, engine.name))
    victim = damage(tmp_path / "step_00000010")

    second = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    with caplog.at_level("WARNING"):
        assert second.load_latest(engine, settings(engine.name)) == state(5, engine.name)
    aside = tmp_path / "damaged_step_00000010"
    assert "skipping checkpoint" in caplog.text and str(aside) in caplog.text
    assert [(s.name, s.path) for s in second.set_aside] == [("step_00000010", aside)]
    assert victim.name in (aside / DAMAGE_NOTE).read_text()
    assert "step_00000010" in damage_report(second.set_aside)
    second.save(engine, state(10, engine.name))
    assert (tmp_path / "latest").read_text() == "step_00000010"

    third = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    assert third.load_latest(engine, settings(engine.name)) == state(10, engine.name)
    assert third.set_aside == []
    assert [p.name for p in third.checkpoints()] == ["step_00000010", "step_00000005"]
    assert aside.is_dir()


def test_checkpoints_set_aside_are_removed_only_when_the_run_asks(tmp_path, engine):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(1, engine.name))
    store.save(engine, state(2, engine.name))
    damage(tmp_path / "step_00000002")
    keeping = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    keeping.load_latest(engine, settings(engine.name))
    keeping.save(engine, state(2, engine.name))
    assert damaged_checkpoints(tmp_path)
    damage(tmp_path / "step_00000002")
    removing = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2, remove_damaged=True)
    removing.load_latest(engine, settings(engine.name))
    assert len(damaged_checkpoints(tmp_path)) == 2  # not before a good one at a higher step
    removing.save(engine, state(2, engine.name))
    assert len(damaged_checkpoints(tmp_path)) == 2
    removing.save(engine, state(3, engine.name))
    assert damaged_checkpoints(tmp_path) == []
    assert [p.name for p in removing.checkpoints()] == ["step_00000003", "step_00000002"]


@pytest.mark.parametrize("remove_damaged", [False, True])
def test_a_run_whose_every_checkpoint_is_damaged_is_refused_not_started_over(
    tmp_path, engine, remove_damaged
):
    """One flipped byte in each kept checkpoint: the job stops naming them (it used to train
    again from step 0 and, with remove_damaged, delete them at its first save); submit
    refuses the run too, and moving them out is the way to start over."""
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    for step in (1, 2):
        store.save(engine, state(step, engine.name))
        victim = damage(tmp_path / f"step_{step:08d}")
    resumed = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2, remove_damaged=remove_damaged)
    with pytest.raises(CheckpointError, match="every checkpoint of this run failed") as refused:
        resumed.load_latest(engine, settings(engine.name))
    assert "damaged_step_00000001, damaged_step_00000002" in str(refused.value)
    assert victim.name in str(refused.value) and "run.name=" in str(refused.value)
    assert len(damaged_checkpoints(tmp_path)) == 2
    with pytest.raises(ConfigError, match="move the damaged_step_\\* directories out"):
        refuse_another_runs_checkpoint(tmp_path, settings(engine.name))
    for damaged in damaged_checkpoints(tmp_path):
        damaged.rename(tmp_path.parent / f"{tmp_path.name}-{damaged.name}")
    assert (
        CheckpointStore(tmp_path, 0, 1, keep=2).load_latest(engine, settings(engine.name)) is None
    )


def test_retention_deletes_nothing_while_fewer_than_keep_checkpoints_are_known_good(
    tmp_path, engine
):
    """keep=3, the newest damaged: the resumed job knows 2 good ones after its save, so the
    never-verified step 1 stays."""
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=3)
    for step in (1, 2, 3):
        store.save(engine, state(step, engine.name))
    damage(tmp_path / "step_00000003")
    resumed = CheckpointStore(tmp_path, rank=0, world_size=1, keep=3)
    resumed.load_latest(engine, settings(engine.name))
    resumed.save(engine, state(4, engine.name))
    resumed.save(engine, state(5, engine.name))
    assert [p.name for p in resumed.checkpoints()] == [
        "step_00000005",
        "step_00000004",
        "step_00000002",
    ]


def unreadable(path):
    """Make `path` a file the kernel refuses to open (a symbolic link to itself: ELOOP), a
    read error as real as EIO, which root's tests cannot cause by permissions."""
    path.unlink()
    path.symlink_to(path.name)


def test_a_checkpoint_file_that_cannot_be_read_stops_the_job_and_nothing_is_moved(tmp_path, engine):
    """A read error is not damage: no fallback to an older checkpoint or to step 0."""
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(1, engine.name))
    store.save(engine, state(2, engine.name))
    newest = tmp_path / "step_00000002"
    victim = newest / sorted(json.loads((newest / "manifest.json").read_text())["files"])[0]
    unreadable(victim)
    resuming = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    with pytest.raises(CheckpointError, match=rf"cannot read .*{victim}: Too many levels"):
        resuming.load_latest(engine, settings(engine.name))
    assert [p.name for p in resuming.checkpoints()] == ["step_00000002", "step_00000001"]
    assert damaged_checkpoints(tmp_path) == []


def test_an_unreadable_manifest_stops_the_job_and_is_refused_at_submit(tmp_path, engine):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(1, engine.name))
    store.save(engine, state(2, engine.name))
    unreadable(tmp_path / "step_00000002" / "manifest.json")
    with pytest.raises(CheckpointError, match="manifest.json: Too many levels.*not a damaged"):
        CheckpointStore(tmp_path, rank=0, world_size=1, keep=2).load_latest(
            engine, settings(engine.name)
        )
    with pytest.raises(ConfigError, match="manifest.json: Too many levels"):
        refuse_another_runs_checkpoint(tmp_path, settings(engine.name))
    assert len(CheckpointStore(tmp_path, rank=0, world_size=1, keep=2).checkpoints()) == 2


def test_half_written_saves_of_a_killed_job_are_removed_at_start(tmp_path, single_rank_group):
    stale = tmp_path / ".step_00000007.partial" / "engine"
    stale.mkdir(parents=True)
    (stale / "shard.pt").write_bytes(b"x" * 1024)
    CheckpointStore(tmp_path, rank=0, world_size=1, keep=2).check_writable()
    assert not (tmp_path / ".step_00000007.partial").exists()


def test_a_checkpoint_directory_others_can_write_is_refused_and_a_group_writable_one_warned(
    tmp_path, single_rank_group, caplog
):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    tmp_path.chmod(0o777)
    with pytest.raises(CheckpointError, match="writable by every user.*chmod o-w"):
        store.check_writable()
    tmp_path.chmod(0o775)
    with caplog.at_level("WARNING"):
        store.check_writable()
    assert "writable by its group" in caplog.text


def test_rng_state_files_load_without_unpickling_code(tmp_path, engine):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    random.seed(5)
    store.save(engine, state(1, engine.name))
    expected = (random.random(), torch.rand(1).item())
    random.seed(9)
    torch.manual_seed(9)
    loaded = torch.load(tmp_path / "step_00000001" / "rng" / "rank_00000.pt", weights_only=True)
    assert set(loaded) >= {"python", "numpy", "torch"}
    store.load_latest(engine, settings(engine.name))
    assert (random.random(), torch.rand(1).item()) == expected


def test_a_gpu_rank_restores_the_cuda_generator_state_of_the_gpu_its_saver_drew_from():
    """A rank saves its own GPU's CUDA generator state. Checkpoints written before hold every
    visible GPU's (8 with --gpus-per-node=8), restored by index onto as many GPUs: an
    IndexError where fewer are visible, another GPU's state where more."""
    # as a GPU's generator states are: seed and offset, 16 bytes
    every_gpu = [torch.tensor([seed, 0]).view(torch.uint8) for seed in range(8)]
    assert cuda_rng_state(every_gpu[3], 3) is every_gpu[3]
    assert cuda_rng_state(every_gpu, 3) is every_gpu[3]  # the saver's own GPU, device 3
    assert cuda_rng_state(every_gpu[:1], 3) is every_gpu[0]  # it saw its own GPU only
    assert cuda_rng_state(every_gpu, 0) is every_gpu[0]  # rank 0's, restored on another layout


def test_keep_below_one_is_refused_by_the_store(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint.keep=0"):
        CheckpointStore(tmp_path, rank=0, world_size=1, keep=0)


def test_checkpoint_of_another_run_is_refused_naming_every_key_that_differs(tmp_path, engine):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(3, engine.name))
    before = params(engine)
    perturb(engine)
    changed = settings(
        engine.name,
        "model.hidden_size=96",
        "data.seq_len=128",
        "train.seed=7",
        "train.grad_accum=2",
    )
    with pytest.raises(CheckpointError) as refused:
        store.load_latest(engine, changed)
    message = str(refused.value)
    for line in [
        "model.hidden_size: 64 in the checkpoint, 96 now",
        "data.seq_len: 256 in the checkpoint, 128 now",
        "train.seed: 0 in the checkpoint, 7 now",
        "train.grad_accum: 1 in the checkpoint, 2 now",
        "train.global_batch: 1 in the checkpoint, 2 now (set by train.micro_batch x train.grad_accum",
    ]:
        assert line in message
    assert "(data.seq_len=256 model.hidden_size=64 train.grad_accum=1 train.seed=0)" in message
    assert "start a new run with another run.name (this job's is run.name=tiny)" in message
    # nothing was loaded
    assert not all(torch.equal(a, b) for a, b in zip(before, params(engine), strict=True))


def test_checkpoint_of_another_zero_stage_is_refused(tmp_path, engine):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(1, engine.name))
    other = dict(settings(engine.name), **{"parallel.zero_stage": 4 - STAGES[engine.name]})
    with pytest.raises(CheckpointError, match=r"parallel\.zero_stage: "):
        store.load_latest(engine, other)


def test_submit_refuses_another_runs_checkpoint_from_the_newest_finished_one(tmp_path, engine):
    """What submit checks before queueing a job: the identity keys of the checkpoint the job
    would resume (a save without manifest is skipped, as the job skips it); the layout is left
    to the job; harmless changes pass."""
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=3)
    store.save(engine, state(1, engine.name))
    store.save(engine, state(2, engine.name))
    (tmp_path / "step_00000002" / "manifest.json").unlink()
    with pytest.raises(ConfigError) as refused:
        refuse_another_runs_checkpoint(tmp_path, settings(engine.name, "model.hidden_size=96"))
    assert str(refused.value).startswith(
        f"checkpoint {tmp_path / 'step_00000001'} belongs to a different run"
    )
    assert "model.hidden_size: 64 in the checkpoint, 96 now" in str(refused.value)
    relaid = dict(
        settings(engine.name, "train.steps=99", "train.lr=1e-4"), **{"parallel.layout": "x"}
    )
    refuse_another_runs_checkpoint(tmp_path, relaid)
    refuse_another_runs_checkpoint(tmp_path / "none", settings(engine.name, "model.hidden_size=96"))


def test_harmless_changes_resume_and_are_logged(tmp_path, engine, caplog):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(2, engine.name))
    changed = settings(
        engine.name,
        "train.steps=200",
        "train.min_lr_ratio=0.5",
        "checkpoint.every_steps=5",
        "trace.memory_steps=[3]",
        "cluster.time_min=5",
    )
    with caplog.at_level("INFO"):
        assert store.load_latest(engine, changed) == state(2, engine.name)
    assert (
        "resuming with changed settings: checkpoint.every_steps null -> 5; cluster.time_min 60 -> 5; "
        "trace.memory_steps [2] -> [3]; train.min_lr_ratio 0.1 -> 0.5; train.steps 20 -> 200"
    ) in caplog.text


def test_changed_learning_rate_and_weight_decay_take_effect_on_resume(tmp_path, engine):
    """The optimizer and schedule states in the checkpoint carry the old values; the new config's win."""
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(1, engine.name))
    changes = [
        "train.lr=1e-3",
        "train.warmup_steps=4",
        "train.weight_decay=0.1",
        "train.betas=[0.8,0.9]",
    ]
    cfg = job_config(STAGES[engine.name], *changes)
    resumed = build_engine(cfg, torch.device("cpu"), STAGES[engine.name])
    store.load_latest(resumed, settings(engine.name, *changes))
    assert (
        resumed.lr() == 1e-3 * lr_factor(0, cfg.train) == 2.5e-4
    )  # its schedule has not stepped yet
    optimizer = resumed.optimizer if engine.name == "fsdp2" else resumed._engine.optimizer
    assert all(
        g["weight_decay"] == 0.1 and g["betas"] == (0.8, 0.9) for g in optimizer.param_groups
    )


def test_unchanged_learning_rate_resumes_bitwise(tmp_path, engine):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(1, engine.name))
    lr = engine.lr()
    store.load_latest(engine, settings(engine.name))
    assert engine.lr() == lr


def test_checkpoint_from_before_recorded_settings_resumes_with_a_warning(tmp_path, engine, caplog):
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(2, engine.name))
    rewrite_as_before_settings(tmp_path / "step_00000002")
    with caplog.at_level("WARNING"):
        resumed = store.load_latest(engine, settings(engine.name, "model.hidden_size=96"))
    assert resumed.step == 2 and resumed.settings is None
    assert "step_00000002 records no run settings" in caplog.text


def test_data_position_that_the_global_batch_does_not_continue_is_refused(tmp_path, engine):
    """A checkpoint without settings whose global batch was 2: this job's batch of 1 would re-read samples."""
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    store.save(engine, state(3, engine.name, samples_per_step=2))
    rewrite_as_before_settings(tmp_path / "step_00000003")
    with pytest.raises(
        CheckpointError, match=r"is at sample 6 after 3 steps, but this job's global batch of 1"
    ):
        store.load_latest(engine, settings(engine.name))


def test_data_prepared_again_at_the_same_path_is_refused_naming_both_contents(tmp_path, engine):
    """The checkpoint records what the prepared directory holds and its tokenizer, not only
    its path: another corpus or tokenizer at the same path does not resume silently."""
    data = tmp_path / "data"
    prepared_dataset(data, [300, 400, 500])
    on_data = ("data.source=tokens", f"data.path={data}")
    store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=2)
    written = settings(engine.name, *on_data)
    store.save(engine, dataclasses.replace(state(1, engine.name), settings=written))
    assert store.load_latest(engine, settings(engine.name, *on_data)).step == 1  # same data

    shutil.rmtree(data)
    prepared_dataset(data, [600, 600])  # another corpus, prepared again at the same path
    summary = json.loads((data / SUMMARY).read_text())
    (data / SUMMARY).write_text(json.dumps({**summary, "tokenizer": {"sha256": "f00d"}}))
    now = settings(engine.name, *on_data)
    with pytest.raises(CheckpointError) as refused:
        store.load_latest(engine, now)
    message = str(refused.value)
    assert (
        f"data.contents: {written['data.contents']} in the checkpoint, {now['data.contents']} now"
        in message
    )
    assert "data.tokenizer: null in the checkpoint, f00d now" in message
    with pytest.raises(ConfigError, match="data.contents: "):
        refuse_another_runs_checkpoint(tmp_path / "checkpoints", now)


def test_a_checkpoint_from_before_the_data_contents_were_recorded_resumes(tmp_path, engine):
    data = prepared_dataset(tmp_path / "data", [300, 400])
    on_data = ("data.source=tokens", f"data.path={data}")
    older = {
        k: v
        for k, v in settings(engine.name, *on_data).items()
        if k not in ("data.contents", "data.tokenizer")
    }
    store = CheckpointStore(tmp_path / "checkpoints", rank=0, world_size=1, keep=2)
    store.save(engine, dataclasses.replace(state(1, engine.name), settings=older))
    assert store.load_latest(engine, settings(engine.name, *on_data)).step == 1


@pytest.mark.parametrize("zero_stage", [1, 3], ids=["zero1", "fsdp2"])
def test_a_resume_with_optimizer_offload_changed_steps_with_its_own_kernel(
    tmp_path, single_rank_group, zero_stage
):
    """The saved param groups carry the kernel they were written with (`fused`): a job that
    now offloads the optimizer (or no longer does) steps with the one its build chose."""
    for saved_offload, resumed_offload in ((False, True), (True, False)):
        root = tmp_path / f"offload_{saved_offload}"
        torch.manual_seed(0)
        cpu = torch.device("cpu")
        first = build_engine(job_config(zero_stage), cpu, zero_stage, saved_offload)
        written = CheckpointStore(root, rank=0, world_size=1, keep=2)
        written.save(first, state(1, first.name))
        resumed = build_engine(job_config(zero_stage), cpu, zero_stage, resumed_offload)
        store = CheckpointStore(root, rank=0, world_size=1, keep=2)
        assert store.load_latest(resumed, settings(resumed.name)) == state(1, resumed.name)
        optimizer = resumed.optimizer if zero_stage == 3 else resumed._engine.optimizer
        fused = {group["fused"] for group in optimizer.param_groups}
        assert fused == {True if resumed_offload else None}, (saved_offload, fused)
