"""One prepare writes an output at a time, from one node or several: the lock is a file naming
its holder, created atomically, so a second prepare is refused by name and never deletes the
first's partial output, while a lock whose prepare is gone is taken over."""

import multiprocessing
import os
import signal
import socket

import pytest
from lock_holders import hold_or_refuse, hold_with_a_worker
from test_data_prepare import prepare, running, sentences, write_jsonl
from test_data_prepare import tokenizer_dir as tokenizer_dir  # the fixture

from slurm_autosp.data.output_lock import lock_path

SPAWN = multiprocessing.get_context("spawn")


def test_a_lock_held_on_another_node_is_refused_naming_it_and_its_partial_output_survives(
    tmp_path, tokenizer_dir, capsys
):
    """Before, the lock was an flock, which Lustre (localflock), BeeGFS and NFS with
    local_lock=flock keep per node: the second prepare took it and deleted the first's partial
    output. The lock file is what a prepare on node gpu-node-17 writes."""
    corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in sentences(20)])
    output, partial = tmp_path / "out", tmp_path / ".out.partial"
    partial.mkdir()
    (partial / "train.tokens").write_text("written on gpu-node-17")
    lock_path(output).write_text("process 4242 on gpu-node-17")

    assert prepare(tokenizer_dir, [corpus], output) == 2
    err = capsys.readouterr().err
    assert (
        f"--output {output}: another prepare (process 4242 on gpu-node-17) is writing it, or "
        "was until its node failed: a process on gpu-node-17 cannot be checked from "
        f"{socket.gethostname()}; wait for it to finish or choose another directory, or, if no "
        f"prepare runs there, remove {lock_path(output)}"
    ) in err
    assert (partial / "train.tokens").read_text() == "written on gpu-node-17"

    lock_path(output).unlink()  # the way out, once that prepare is known to be gone
    assert prepare(tokenizer_dir, [corpus], output) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]


@pytest.mark.slow
def test_of_two_prepares_racing_for_an_output_one_writes_and_the_other_is_refused_naming_it(
    tmp_path, tokenizer_dir, capsys
):
    output, partial = tmp_path / "out", tmp_path / ".out.partial"
    go, release, results = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    racers = [SPAWN.Process(target=hold_or_refuse, args=(output, go, release, results)) for _ in range(2)]  # fmt: skip
    for racer in racers:
        racer.start()
    try:
        go.set()
        outcomes = dict(sorted(results.get(timeout=300) for _ in racers))
        assert sorted(outcomes) == ["held", "refused"], outcomes
        winner = outcomes["held"]
        assert outcomes["refused"] == (
            f"another prepare (process {winner} on {socket.gethostname()}) is writing it; wait "
            "for it to finish or choose another directory"
        )
        corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in sentences(20)])
        assert prepare(tokenizer_dir, [corpus], output) == 2
        assert f"--output {output}: another prepare (process {winner} on " in capsys.readouterr().err  # fmt: skip
        assert (partial / "train.tokens").read_text() == f"written by process {winner}"
    finally:
        release.set()
        for racer in racers:
            racer.join(timeout=120)
    assert [racer.exitcode for racer in racers] == [0, 0]
    assert not lock_path(output).exists()


@pytest.mark.slow
def test_the_lock_of_a_killed_prepare_is_taken_over_though_a_worker_it_forked_lives_on(
    tmp_path, tokenizer_dir
):
    """Before, the lock was an flock its forked workers shared: until the last of them had
    exited, the next prepare was refused, naming the dead one."""
    output = tmp_path / "out"
    done, results = SPAWN.Event(), SPAWN.Queue()
    holder = SPAWN.Process(target=hold_with_a_worker, args=(output, done, results))
    holder.start()
    try:
        pid, worker = results.get(timeout=300)
        os.kill(pid, signal.SIGKILL)
        holder.join()
        assert running(worker)  # and holds no lock
        assert lock_path(output).read_text() == f"process {pid} on {socket.gethostname()}"

        corpus = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in sentences(20)])
        assert prepare(tokenizer_dir, [corpus], output) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]
    finally:
        holder.kill()  # if the test failed before killing it
        done.set()
