"""The optimizer's kernel: torch's fused AdamW wherever foreach's temporaries would cost GPU
memory the plan does not count, or the step runs in host memory."""

from pathlib import Path

from torch import nn

from slurm_autosp.config import load_config
from slurm_autosp.optim import build_optimizer, fused_kernel

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_gpu_jobs_and_offloaded_optimizers_step_with_the_fused_kernel_cpu_jobs_with_foreach():
    gpu = load_config([f"cfg={CONFIGS / 'llama8b_32k.yaml'}"])
    cpu = load_config([f"cfg={CONFIGS / 'tiny_cpu.yaml'}"])
    assert fused_kernel(gpu.cluster, offload_optimizer=False)
    assert fused_kernel(cpu.cluster, offload_optimizer=True)
    assert not fused_kernel(cpu.cluster, offload_optimizer=False)
    layer = nn.Linear(4, 4)
    assert build_optimizer(layer, cpu.train, fused=True).defaults["fused"] is True
    assert build_optimizer(layer, cpu.train).defaults["fused"] is None  # foreach where it can
