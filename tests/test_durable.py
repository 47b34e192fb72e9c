"""Renames into place are durable: every file and directory of a prepared dataset, an HF export
or a checkpoint is forced to stable storage before it takes its final name, and its parent
after. Seen through the calls to os.fsync and os.rename (a crash of the node cannot be had
here): each is recorded with the path it acts on, in order, and the real call made."""

import os
from pathlib import Path

import pytest
from test_checkpoint_store import engine, state  # noqa: F401
from test_data_prepare import prepare, sentences, tokenizer_dir, write_jsonl  # noqa: F401

from slurm_autosp.checkpoint.store import CheckpointStore
from slurm_autosp.lifecycle.durable import rename_durably


@pytest.fixture
def synced(monkeypatch):
    """The (call, path) of every fsync and rename, in order."""
    calls: list[tuple[str, str]] = []
    fsync, rename = os.fsync, os.rename

    def recorded_fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_rename(source, target, *args, **kwargs):
        calls.append(("rename", str(source)))
        rename(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "rename", recorded_rename)
    return calls


def assert_forced_before_renamed(calls, source: Path, target: Path, tree: list[str]):
    """Each of `tree` (paths relative to `source`) was fsynced below `source` before it was
    renamed to `target`, and `target`'s parent after."""
    renamed = calls.index(("rename", str(source)))
    before = {path for call, path in calls[:renamed] if call == "fsync"}
    missing = [name for name in tree if str(source / name).rstrip("/.") not in before]
    assert not missing, f"not forced to storage before the rename: {missing}"
    assert ("fsync", str(target.parent)) in calls[renamed:]


def tree_of(root: Path) -> list[str]:
    return [".", *(str(p.relative_to(root)) for p in sorted(root.rglob("*")))]


def test_a_tree_is_forced_to_storage_then_renamed_then_its_parent(tmp_path, synced):
    source = tmp_path / ".out.partial"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "a.bin").write_bytes(b"a")
    (source / "b.json").write_text("{}")
    tree = tree_of(source)
    rename_durably(source, tmp_path / "out")
    assert_forced_before_renamed(synced, source, tmp_path / "out", tree)
    assert (tmp_path / "out" / "sub" / "a.bin").read_bytes() == b"a"


def test_a_prepared_dataset_is_on_storage_before_it_takes_its_name(
    tmp_path,
    tokenizer_dir,  # noqa: F811
    synced,
):
    corpus = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in sentences(50)])
    output = tmp_path / "prepared"
    assert prepare(tokenizer_dir, [corpus], output) == 0
    partial = tmp_path / ".prepared.partial"
    assert_forced_before_renamed(synced, partial, output, tree_of(output))


def test_a_checkpoints_directories_are_on_storage_before_it_takes_its_name(
    tmp_path,
    engine,  # noqa: F811
    synced,
):
    """Its files are forced as they are hashed; its directories (engine/, rng/) before the
    rename that makes it a checkpoint."""
    store = CheckpointStore(tmp_path, rank=0, world_size=1, keep=2)
    final = store.save(engine, state(1, engine.name))
    directories = [".", *(str(p.relative_to(final)) for p in final.rglob("*") if p.is_dir())]
    assert len(directories) > 2
    assert_forced_before_renamed(synced, tmp_path / ".step_00000001.partial", final, directories)
