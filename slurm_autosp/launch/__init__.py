"""The way into a job: the submitit executor (sbatch or local processes), what every rank
runs, and following a job from a terminal."""
