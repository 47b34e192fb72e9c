"""python -m slurm_autosp COMMAND [ARGUMENTS]: the console script's commands where `slurm-autosp`
is not on PATH (commands/console.py)."""

import sys

from slurm_autosp.commands.console import main

sys.exit(main())
