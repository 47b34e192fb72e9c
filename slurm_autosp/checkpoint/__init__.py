"""Training state on shared storage: atomic checkpoints with a manifest, finding the newest
good one, whether a job may resume it, and the Hugging Face export."""
