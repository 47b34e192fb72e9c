"""python -m slurm_autosp.run cfg=CONFIG.yaml [key=value ...]

One rank of a training job, for sites that submit their own sbatch scripts: `srun` starts it
on every task (see sbatch/train.sbatch). It runs exactly what `slurm_autosp.submit` would
run in each task, reading ranks and hosts from SLURM's environment.
"""

from __future__ import annotations

import os
import sys

from slurm_autosp.checkpoint.lock import write_lock
from slurm_autosp.cli import arguments, config_error
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.data import check_token_file
from slurm_autosp.launch.job import TrainingJob
from slurm_autosp.launch.placement import plan_layout
from slurm_autosp.model import model_vocab_size, refuse_unsupported_attention
from slurm_autosp.submit import prepare_run_dir


def main(argv: list[str] | None = None) -> int:
    argv = arguments(argv, __doc__)
    if argv is None:
        return 0
    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")
    try:
        cfg = load_config(argv)
        refuse_unsupported_attention(cfg)
        check_token_file(cfg, model_vocab_size(cfg.model))
        plan_layout(cfg)
        if (
            os.environ.get("SLURM_PROCID", "0") == "0"
            and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        ):
            prepare_run_dir(cfg)
            write_lock(cfg.run.dir, os.environ.get("SLURM_JOB_ID", str(os.getpid())), "slurm")
    except ConfigError as err:
        return config_error(err)
    TrainingJob(cfg)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
