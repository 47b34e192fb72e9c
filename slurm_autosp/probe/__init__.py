"""`python -m slurm_autosp probe`: a short job on the very nodes a long run will use, measuring
what the plan and the pages under docs/ promise (collective bandwidth, step time, MFU, memory per rank)."""
