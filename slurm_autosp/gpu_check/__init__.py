"""The GPU check: the first GPU evidence on one machine in one command, within a borrowed
machine's run (`python -m slurm_autosp gpu-check`; its help says what it measures). It reuses the probe's kernel checks, step runner and plan prediction."""
