"""Samples are addressed by a global index: the same on every run, rank count and restart."""

import numpy as np
import pytest
import torch
from in_process import run_command

from slurm_autosp.commands.submit import main as submit_main
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.data import (
    BlendedSource,
    ShuffledSource,
    SyntheticSource,
    TokenFileSource,
    build_source,
    check_token_file,
    micro_batch,
    open_eval_source,
    write_token_file,
)


def successor_walk(src: SyntheticSource, index: int) -> torch.Tensor:
    """The synthetic stream's definition, one token at a time (the reference the vectorised
    source must equal bit for bit: resumed runs compare losses against earlier ones)."""
    rng = np.random.default_rng((src.seed, index))
    jumps = rng.random(src.seq_len) < src.noise
    random_tokens = rng.integers(0, src.vocab_size, src.seq_len)
    tokens = np.empty(src.seq_len, dtype=np.int64)
    tokens[0] = random_tokens[0]
    for t in range(1, src.seq_len):
        tokens[t] = random_tokens[t] if jumps[t] else src.successor[tokens[t - 1]]
    return torch.from_numpy(tokens)


def test_synthetic_samples_are_deterministic_and_distinct():
    a, b = SyntheticSource(256, 64, seed=1), SyntheticSource(256, 64, seed=1)
    assert torch.equal(a.sample(5).input_ids, b.sample(5).input_ids)
    assert not torch.equal(a.sample(5).input_ids, a.sample(6).input_ids)
    assert a.sample(0).input_ids.dtype == torch.int64 and a.sample(0).input_ids.max() < 256
    assert a.sample(0).labels is None


@pytest.mark.parametrize(
    ("vocab", "seq_len", "noise"),
    [(256, 512, 0.1), (1, 20, 0.1), (2, 64, 0.0), (7, 300, 0.5), (128256, 131072, 0.1)],
)
def test_synthetic_samples_equal_the_token_by_token_walk(vocab, seq_len, noise):
    src = SyntheticSource(vocab, seq_len, seed=3, noise=noise)
    for index in range(3):
        assert torch.equal(src.sample(index).input_ids, successor_walk(src, index))


def test_synthetic_tokens_mostly_follow_the_successor_table():
    src = SyntheticSource(256, 512, seed=0)
    tokens = src.sample(3).input_ids.numpy()
    follows = (src.successor[tokens[:-1]] == tokens[1:]).mean()
    assert 0.85 < follows < 0.95


def test_token_file_round_trips_uint32_ids_beyond_uint16(tmp_path):
    tokens = np.array([0, 70000, 128255, 5, 6, 7, 8, 9], dtype=np.int64)
    path = tmp_path / "toks.bin"
    write_token_file(path, tokens, vocab_size=128256)
    src = TokenFileSource(path, seq_len=4)
    assert src.num_samples == 2
    assert src.sample(0).input_ids.tolist() == [0, 70000, 128255, 5]
    assert src.sample(3).input_ids.tolist() == [6, 7, 8, 9]  # wraps: sample 3 == sample 1


def test_token_file_refuses_ids_outside_the_vocabulary(tmp_path):
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 10\)"):
        write_token_file(tmp_path / "t.bin", np.array([3, 10]), vocab_size=10)


def test_token_file_larger_vocabulary_than_the_model_is_refused(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file(path, np.arange(100), vocab_size=1000)
    with pytest.raises(ValueError, match=r"vocabulary of 1000 but model\.vocab_size=256"):
        TokenFileSource(path, seq_len=10, vocab_size=256)


def test_not_a_token_file_is_named(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(b"hello world, not tokens at all")
    with pytest.raises(ValueError, match=r"t\.bin: not a token file"):
        TokenFileSource(path, seq_len=4)


def test_micro_batches_cover_each_step_without_overlap():
    cfg = load_config(["train.micro_batch=2", "train.grad_accum=2", "data.seq_len=8"])
    src = SyntheticSource(256, 8, seed=0)
    seen = [
        micro_batch(src, cfg, step, m, r)
        for step in range(2)
        for m in range(2)
        for r in range(cfg.dp_size)
    ]
    assert all(batch.labels is None for batch in seen)
    rows = torch.cat([batch.input_ids for batch in seen])
    assert rows.shape == (2 * 2 * 2 * 2, 8)
    assert len({tuple(r.tolist()) for r in rows}) == len(rows)
    assert torch.equal(rows[0], src.sample(0).input_ids)
    assert torch.equal(rows[-1], src.sample(15).input_ids)


def test_shuffled_epochs_read_every_sample_once_in_a_new_order(tmp_path):
    path = tmp_path / "toks.bin"
    write_token_file(path, np.arange(40 * 4) % 256, vocab_size=256)
    shuffled = ShuffledSource(TokenFileSource(path, seq_len=4), seed=7)
    first = [int(shuffled.sample(i).input_ids[0]) // 4 for i in range(40)]
    second = [int(shuffled.sample(40 + i).input_ids[0]) // 4 for i in range(40)]
    assert sorted(first) == sorted(second) == list(range(40))
    assert first != list(range(40)) and first != second


def test_the_shuffled_order_is_a_function_of_the_global_index_alone(tmp_path):
    """A resumed run, or one on another world size, asks for the same indices in another
    order (or from a fresh process): it must read the same samples."""
    path = tmp_path / "toks.bin"
    write_token_file(path, np.arange(50 * 4) % 256, vocab_size=256)
    forward = ShuffledSource(TokenFileSource(path, seq_len=4), seed=1)
    indices = [0, 1, 49, 50, 51, 120, 3]
    expected = [forward.sample(i).input_ids for i in indices]
    fresh = ShuffledSource(TokenFileSource(path, seq_len=4), seed=1)
    for i, tokens in reversed(list(zip(indices, expected, strict=True))):
        assert torch.equal(fresh.sample(i).input_ids, tokens)


def test_token_data_is_shuffled_unless_data_shuffle_is_false(tmp_path):
    path = tmp_path / "toks.bin"
    write_token_file(path, np.arange(64 * 16) % 256, vocab_size=256)
    keys = ["cfg=configs/tiny_cpu.yaml", "data.source=tokens", f"data.path={path}"]
    assert isinstance(build_source(load_config([*keys, "data.seq_len=16"])), ShuffledSource)
    plain = build_source(load_config([*keys, "data.seq_len=16", "data.shuffle=false"]))
    assert isinstance(plain, TokenFileSource)


def test_a_truncated_token_file_names_its_path_and_sizes(tmp_path):
    path = tmp_path / "cut.bin"
    write_token_file(path, np.arange(100), vocab_size=256)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match=r"cut\.bin: truncated: its header promises 100 tokens"):
        TokenFileSource(path, seq_len=8)


def test_the_token_file_is_checked_against_the_vocabulary_of_the_model_trained(tmp_path):
    """A pretrained checkpoint's vocabulary, not the config's field, is what embeds the ids."""
    path = tmp_path / "toks.bin"
    write_token_file(path, np.arange(64), vocab_size=300)
    cfg = load_config(
        ["cfg=configs/tiny_cpu.yaml", "data.source=tokens", f"data.path={path}", "data.seq_len=16"]
    )
    check_token_file(cfg, 512)
    with pytest.raises(
        ConfigError, match=rf"data.path={path}: .*vocabulary of 300 but model.vocab_size=256"
    ):
        check_token_file(cfg, 256)


def test_submit_refuses_a_truncated_token_file_before_any_rank_starts(tmp_path):
    path = tmp_path / "cut.bin"
    write_token_file(path, np.arange(4096) % 256, vocab_size=256)
    path.write_bytes(path.read_bytes()[:-4])
    proc = run_command(
        submit_main,
        "cfg=configs/tiny_cpu.yaml",
        "data.source=tokens",
        f"data.path={path}",
        f"run.output_root={tmp_path / 'runs'}",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"data.path={path}: {path}: truncated" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_held_out_data_shorter_than_one_sample_is_refused_naming_how_to_turn_evaluation_off(
    tmp_path,
):
    train, held_out = tmp_path / "train.bin", tmp_path / "eval.bin"
    write_token_file(train, np.arange(64) % 256, vocab_size=256)
    write_token_file(held_out, np.arange(10), vocab_size=256)
    data = ["data.source=tokens", f"data.path={train}", "data.seq_len=16"]
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", *data, f"data.eval_path={held_out}"])
    with pytest.raises(
        ConfigError,
        match=rf"data.eval_path={held_out} \(held-out data\): .*10 tokens is less than one "
        r"sample of data.seq_len=16; or turn evaluation off with train.eval_samples=0",
    ):
        check_token_file(cfg, 256)
    off = load_config(
        ["cfg=configs/tiny_cpu.yaml", *data, f"data.eval_path={held_out}", "train.eval_samples=0"]
    )
    check_token_file(off, 256)
    assert open_eval_source(off, 256) is None  # no evaluator is built


def test_eval_samples_may_be_zero_but_not_negative():
    with pytest.raises(
        ConfigError, match=r"train.eval_samples=-1 must be >= 0 \(0: no evaluation\)"
    ):
        load_config(["train.eval_samples=-1"])


def test_a_blend_reads_each_dataset_by_its_weight_in_its_own_order(tmp_path):
    sources = []
    for name, first in (("a", 0), ("b", 100)):
        write_token_file(tmp_path / f"{name}.bin", first + np.arange(50 * 2) % 100, vocab_size=256)
        sources.append(TokenFileSource(tmp_path / f"{name}.bin", seq_len=2))
    blend = BlendedSource(sources, [3.0, 1.0], seed=0, block=8)
    firsts = [int(blend.sample(i).input_ids[0]) for i in range(80)]
    from_a = [t for t in firsts if t < 100]
    from_b = [t - 100 for t in firsts if t >= 100]
    assert len(from_a) == 60 and len(from_b) == 20
    assert from_a == [2 * (i % 50) for i in range(60)]  # in order, wrapping after 50 samples
    assert from_b == [2 * i for i in range(20)]
    assert firsts[:8] != sorted(firsts[:8], key=lambda t: t >= 100)  # interleaved, seeded
    fresh = BlendedSource(sources, [3.0, 1.0], seed=0, block=8)
    assert [int(fresh.sample(i).input_ids[0]) for i in reversed(range(80))] == firsts[::-1]


def test_blend_weights_are_checked_before_any_rank_starts(tmp_path):
    for name in ("a", "b"):
        write_token_file(tmp_path / f"{name}.bin", np.arange(64) % 256, vocab_size=256)
    blend = f"data.blend={{{tmp_path}/a.bin: 3, {tmp_path}/b.bin: 1}}"
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", "data.source=tokens", "data.seq_len=8", blend])
    assert isinstance(build_source(cfg), BlendedSource)
    check_token_file(cfg, 256)
    tiny = f"data.blend={{{tmp_path}/a.bin: 1, {tmp_path}/b.bin: 0.0001}}"
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", "data.source=tokens", "data.seq_len=8", tiny])
    with pytest.raises(ConfigError, match=r"each must be at least 1/1000 of their sum"):
        check_token_file(cfg, 256)
    with pytest.raises(ConfigError, match=r"data\.blend and data\.path are exclusive"):
        load_config(["data.source=tokens", blend, f"data.path={tmp_path}/a.bin"])
    with pytest.raises(ConfigError, match=r"data\.blend: .*missing\.bin: no such file"):
        load_config(["data.source=tokens", f"data.blend={{{tmp_path}/missing.bin: 1}}"])
