"""The whole job as one tree of typed dataclasses.

`load_config(["cfg=configs/x.yaml", "train.steps=10"])` merges a YAML file and dotlist
overrides onto these dataclasses (OmegaConf structured configs), so unknown keys and wrong
types fail with the key's full path before anything is submitted. `validate` then checks what
types cannot: values that are out of range and fields that contradict each other.
"""

from slurm_autosp.config.load import (
    DEFAULT_CONFIG,
    load_config,
    resolve_ring_size,
    to_yaml,
    with_default_config,
)
from slurm_autosp.config.schema import (
    ActivationCheckpointing,
    Backend,
    CheckpointConfig,
    ClusterConfig,
    CompileConfig,
    ConfigError,
    DataConfig,
    DataSource,
    DocumentBoundaries,
    Fabric,
    JobConfig,
    LoraConfig,
    LrSchedule,
    ModelConfig,
    ParallelConfig,
    Precision,
    ProbeConfig,
    RunConfig,
    StopAt,
    TraceConfig,
    TrainConfig,
    Vendor,
)
from slurm_autosp.config.validate import (
    MAX_SIGNAL_DELAY_S,
    USER_PORTS,
    ZERO_STAGES,
    is_user_port,
    validate,
)

__all__ = [
    "ActivationCheckpointing",
    "Backend",
    "CheckpointConfig",
    "ClusterConfig",
    "CompileConfig",
    "ConfigError",
    "DEFAULT_CONFIG",
    "DataConfig",
    "DataSource",
    "DocumentBoundaries",
    "Fabric",
    "JobConfig",
    "LoraConfig",
    "LrSchedule",
    "MAX_SIGNAL_DELAY_S",
    "ModelConfig",
    "ParallelConfig",
    "Precision",
    "ProbeConfig",
    "RunConfig",
    "StopAt",
    "TraceConfig",
    "TrainConfig",
    "USER_PORTS",
    "Vendor",
    "ZERO_STAGES",
    "is_user_port",
    "load_config",
    "resolve_ring_size",
    "to_yaml",
    "validate",
    "with_default_config",
]
