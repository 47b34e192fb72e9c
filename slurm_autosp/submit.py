"""python -m slurm_autosp.submit cfg=CONFIG.yaml [key=value ...]: the submit command
(commands/submit.py) under the name it has always had."""

import sys

from slurm_autosp.commands.submit import main

if __name__ == "__main__":
    sys.exit(main())
