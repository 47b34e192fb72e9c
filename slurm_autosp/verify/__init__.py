"""Check, before spending GPU hours, that AutoSP trains your model exactly as one device would:
`python -m slurm_autosp verify` (the command and its arguments: commands/verify.py).

options: the `verify.*` keys and the shrunk model; documents: the packed rows
`verify.documents` checks; ranks: what every rank runs; report: the figures, which fail and
why; check: spawning the ranks and refusing what they cannot run.
"""

from slurm_autosp.verify.check import admit_verify, run_verify
from slurm_autosp.verify.options import (
    Inject,
    VerifyOptions,
    load_options,
    shrink_model_config,
    split_arguments,
    verify_seq_len,
)
from slurm_autosp.verify.packed_rows import DocumentLayout, choose_layout, verify_layout
from slurm_autosp.verify.ranks import (
    compare_sp_step,
    full_fp32,
    make_batch,
    run_rank,
    shift_labels_per_shard,
)
from slurm_autosp.verify.report import Report, failures, format_report

__all__ = [
    "DocumentLayout",
    "Inject",
    "Report",
    "VerifyOptions",
    "admit_verify",
    "choose_layout",
    "compare_sp_step",
    "failures",
    "format_report",
    "full_fp32",
    "load_options",
    "make_batch",
    "run_rank",
    "run_verify",
    "shift_labels_per_shard",
    "shrink_model_config",
    "split_arguments",
    "verify_layout",
    "verify_seq_len",
]
