"""The family battery (issue #35, part 4): every causal-LM family the installed transformers
maps, built tiny (tests/families.py), trains exactly at SP=2 or is refused by name before
any rank starts. Never a traceback: a crash fails its case with the rank's traceback.

One shared pool of 2 ranks runs every family's verify step (no process per family)."""

import pytest
from families import EXPECTED, REASONS, Case, Outcome, battery_step, cases

from slurm_autosp.config import ConfigError
from slurm_autosp.verify import VerifyOptions, admit_verify, failures

# verify's defaults (2 layers, 61-token sequences, 1e-5) without inductor's code generation:
# what differs between families is Dynamo's capture and the SP rewrite, checked in 1-5 s a
# family rather than a minute of C++ compilation; inductor's kernels are the other tests'
OPTIONS = VerifyOptions(codegen=False)


def outcome_of(case: Case, pool) -> tuple[Outcome, str]:
    """What `python -m slurm_autosp verify` would say: refused (exit 2), or its report."""
    cfg = case.job_config()
    try:
        admit_verify(cfg, OPTIONS)
    except ConfigError as refused:
        return Outcome.refused, str(refused)
    report = pool.run(battery_step, cfg, OPTIONS)[0]
    problems = failures(report, OPTIONS.tolerance)
    return (Outcome.inexact, "\n".join(problems)) if problems else (Outcome.exact, "")


def test_every_case_has_an_expected_outcome_and_none_is_stale():
    """A family a new transformers brings needs an entry (and docs/compiler.md's families table a row)."""
    names = {case.name for case in cases()}
    assert not names - set(EXPECTED), f"add to families.EXPECTED: {sorted(names - set(EXPECTED))}"
    assert not set(EXPECTED) - names, f"stale in EXPECTED: {sorted(set(EXPECTED) - names)}"
    assert all(e.reason in REASONS for e in EXPECTED.values() if e.outcome is not Outcome.exact)


@pytest.mark.slow
@pytest.mark.parametrize("case", cases(), ids=lambda case: case.name)
def test_family_trains_exactly_at_sp2_or_is_refused_by_name(case, pool2):
    outcome, message = outcome_of(case, pool2)
    if outcome is Outcome.refused:  # as submit would: exit 2, naming the family
        assert f"model.model_type={case.model_type}" in message, message
    expected = EXPECTED.get(case.name)
    if expected is None:  # a family this table does not know yet: the invariant alone
        assert outcome in (Outcome.exact, Outcome.refused), message
        return
    assert outcome is expected.outcome, (
        f"{case.name}: {outcome.value}, expected {expected}\n{message}"
    )
    if expected.outcome is Outcome.refused:
        assert REASONS[expected.reason][0] in message, message
