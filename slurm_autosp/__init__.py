"""Long-context training with automatic sequence parallelism, submitted to SLURM."""

__version__ = "0.1.0"
