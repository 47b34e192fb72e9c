"""The command lines, one module each with `main(argv) -> exit status`: they parse, call the
library, and print; the library raises. `slurm-autosp COMMAND` (console.py) runs any of them,
as does `python -m slurm_autosp COMMAND`; `python -m slurm_autosp.submit` (the name the card
gives) and `python -m slurm_autosp.run` (stored sbatch scripts) keep their own names."""
