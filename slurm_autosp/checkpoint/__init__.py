"""Checkpoints that survive preemption, time limits and crashes, and resume exactly."""
