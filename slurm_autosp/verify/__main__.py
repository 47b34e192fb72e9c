"""python -m slurm_autosp.verify cfg=CONFIG.yaml [...]: the verify command (commands/verify.py)
under the name it has always had."""

import sys

from slurm_autosp.commands.verify import main

sys.exit(main())
