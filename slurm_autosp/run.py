"""python -m slurm_autosp.run cfg=CONFIG.yaml [...]: the run command (commands/run.py) under the
name sbatch scripts written before it moved call it by; SLURM runs a stored script again on
each requeue."""

import sys

from slurm_autosp.commands.run import main

if __name__ == "__main__":
    sys.exit(main())
