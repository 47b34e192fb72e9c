"""python -m slurm_autosp.gpu_check [--out DIR] [--device cuda|cpu] [--tiny] [--eager]"""

import sys

from slurm_autosp.gpu_check.check import main

if __name__ == "__main__":
    sys.exit(main())
