"""A job's config from a YAML file and dotlist overrides, each failure named by its full key;
then validated, and a null ring size resolved once so no reader resolves it again."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from slurm_autosp.config.schema import ConfigError, JobConfig
from slurm_autosp.config.validate import validate
from slurm_autosp.heads import auto_ring_size

# What a command given no cfg= trains: the tiny CPU job of README's first command, shipped in
# the package so an installed wheel has it (configs/tiny_cpu.yaml is a link to it).
DEFAULT_CONFIG = Path(__file__).with_name("tiny_cpu.yaml")


def with_default_config(argv: list[str]) -> list[str]:
    """The command's arguments, with cfg= the default config when they name none: the
    schema's own defaults are only the base every YAML file is merged onto."""
    if any(arg.startswith("cfg=") for arg in argv):
        return argv
    return [f"cfg={DEFAULT_CONFIG}", *argv]


def load_config(argv: list[str]) -> JobConfig:
    """Merge `cfg=PATH.yaml` and `a.b=c` overrides onto the defaults, then validate."""
    cfg_path = None
    overrides = []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(
                f"argument {arg!r} is not key=value; use cfg=PATH.yaml and overrides like "
                "train.steps=100"
            )
        key, value = arg.split("=", 1)
        if key == "cfg":
            cfg_path = value
        else:
            overrides.append(arg)

    merged: DictConfig = OmegaConf.structured(JobConfig)
    if cfg_path is not None:
        merged = _merge(merged, _read_yaml(cfg_path), f"in {cfg_path}")
    merged = _merge(merged, _parse_overrides(overrides), "on the command line")
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, JobConfig)
    validate(cfg)
    if cfg.parallel.ring_size is None:
        cfg.parallel.ring_size = resolve_ring_size(cfg)
    return cfg


def resolve_ring_size(cfg: JobConfig) -> int:
    """The ring size a null `parallel.ring_size` stands for: the Ulysses size as large as the
    model's heads (a checkpoint's own) and the profile's NVLink domains allow, the ring the
    rest (heads.auto_ring_size)."""
    heads, kv_heads = cfg.model.heads()
    return auto_ring_size(
        cfg.parallel.sp_size,
        cfg.cluster.nvlink_domain_gcd(),
        heads,
        kv_heads,
        cfg.parallel.allow_cross_domain,
    )


def to_yaml(cfg: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _read_yaml(path: str) -> DictConfig:
    if not os.path.isfile(path):
        raise ConfigError(
            f"cfg={path}: no such file (give the path of a YAML config, e.g. configs/tiny_cpu.yaml)"
        )
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError and friends
        raise ConfigError(f"cfg={path}: not valid YAML: {err}") from err
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"cfg={path}: expected a mapping of sections (run:, model:, train:, ...)")
    return loaded


def _parse_overrides(overrides: list[str]) -> DictConfig:
    """The overrides as one config; each value is read as YAML, so one YAML cannot read is named,
    and so is one YAML would cut at ' #' (a comment: run.name=exp #1 would read as exp)."""
    for override in overrides:
        key, _, value = override.partition("=")
        try:
            read = OmegaConf.from_dotlist([override])
        except Exception as err:  # OmegaConf's own errors and yaml's scanner/parser errors alike
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            hint = "; quote it" if isinstance(err, yaml.YAMLError) else ""
            raise ConfigError(
                f"{key} on the command line: cannot read the value {value!r} ({reason}){hint}, "
                f"e.g. {key}='\"{value}\"' in the shell"
            ) from err
        if "#" in value and "#" not in str(OmegaConf.to_container(read)):
            raise ConfigError(
                f"{key} on the command line: the value {value!r} would read as "
                f"{OmegaConf.select(read, key)!r} (YAML takes ' #' and what follows for a "
                f"comment); quote it, e.g. {key}='\"{value}\"' in the shell"
            )
    return OmegaConf.from_dotlist(overrides)


def _merge(base: DictConfig, update: DictConfig, where: str) -> DictConfig:
    try:
        merged = OmegaConf.merge(base, update)
    except OmegaConfBaseException as err:
        raise ConfigError(_explain(err, where)) from err
    assert isinstance(merged, DictConfig)  # two DictConfigs merge into one
    return merged


def _explain(err: OmegaConfBaseException, where: str) -> str:
    """One line naming the full key, OmegaConf's reason, and the keys that section accepts."""
    key = getattr(err, "full_key", None) or "?"
    reason = str(err).splitlines()[0]
    section = getattr(err, "object_type", None)
    if isinstance(err, ConfigKeyError) and dataclasses.is_dataclass(section):
        known = ", ".join(f.name for f in dataclasses.fields(section))
        return f"{key} {where}: unknown key. {reason} Known keys here: {known}"
    return f"{key} {where}: {reason}"
