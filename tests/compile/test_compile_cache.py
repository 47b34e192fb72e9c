"""Compile caches: a restarted job's compile is served from AOTAutograd's cache (no retrace of
forward and backward), and the cache key changes with our ops' code, whose backward formulas
the cached graphs hold. Rank-side functions live here too (the pool imports them by name)."""

from pathlib import Path

import pytest
import torch
from sp_cases import Case, sp_step
from torch._dynamo.utils import counters

import slurm_autosp.sp.all_to_all as all_to_all
from slurm_autosp.compile.activation_checkpointing import code_key


def compile_twice(case: Case) -> list[dict]:
    """One SP step compiled from scratch, twice, as a job and its restart do; each attempt's
    errors against the single-device reference and AOTAutograd's cache counters."""
    attempts = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        errors = sp_step(case, 2)
        attempts.append({**errors, **counters["aot_autograd"]})
    return attempts


@pytest.mark.slow
def test_a_restarted_compile_is_served_from_aotautograds_cache(pool2):
    """The all-to-alls the backend inserts carry Dynamo's example values: without them
    AOTAutograd bypassed its cache ("Unsupported call_method target sp_all_to_all") and every
    start traced and partitioned forward and backward again."""
    # test_sp_equivalence's plain case: whichever runs first compiles it cold, once
    for first, restart in pool2.run(compile_twice, Case()):
        assert first.get("autograd_cache_bypass", 0) == 0, first
        assert restart.get("autograd_cache_hit", 0) >= 1 and "autograd_cache_bypass" not in restart
        for attempt in (first, restart):
            assert max(attempt[k] for k in ("loss_rel_error", "grad_rel_error")) <= 1e-5, attempt


def test_the_compile_cache_key_changes_with_our_ops_code(tmp_path, monkeypatch):
    """A changed backward formula of sp_all_to_all must never be served from a cache written
    by the code before it."""
    before = code_key()
    changed = tmp_path / "all_to_all.py"
    changed.write_text(Path(all_to_all.__file__).read_text() + "\n# a changed formula\n")
    monkeypatch.setattr(all_to_all, "__file__", str(changed))
    assert code_key() != before
