"""python -m slurm_autosp.verify: see slurm_autosp.verify.command."""

import sys

from slurm_autosp.verify.command import main

sys.exit(main())
