"""The compute that offload and ring traffic has to hide behind, modelled before any GPU runs:
the GPU's peak (`trace.peak_tflops_per_gpu`, else an H100's) at REFERENCE_MFU."""

from __future__ import annotations

from slurm_autosp.config import TraceConfig

REFERENCE_TFLOPS = 989.0  # H100/H200 dense bf16, when trace.peak_tflops_per_gpu is not set
REFERENCE_MFU = 0.4  # the compute the offload traffic has to hide behind


def peak_tflops(trace: TraceConfig) -> float:
    return trace.peak_tflops_per_gpu or REFERENCE_TFLOPS


def compute_seconds(trace: TraceConfig, flops: float) -> float:
    return flops / (peak_tflops(trace) * 1e12 * REFERENCE_MFU)
