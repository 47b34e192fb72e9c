"""Bad configuration fails at once, naming the key, the problem and what would work."""

import dataclasses
import typing

import pytest

from slurm_autosp.config import ConfigError, DataSource, JobConfig, load_config

CONFIGS = [
    "configs/tiny_cpu.yaml",
    "configs/llama8b_32k.yaml",
    "configs/llama70b_128k.yaml",
    "configs/llama8b_256k_lora.yaml",
]


@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_configs_load(path):
    cfg = load_config([f"cfg={path}"])
    assert isinstance(cfg, JobConfig)


def test_llama_configs_have_the_real_llama31_shapes():
    m8 = load_config(["cfg=configs/llama8b_32k.yaml"])
    m70 = load_config(["cfg=configs/llama70b_128k.yaml"])

    def shape(c):
        return (
            c.model.hidden_size,
            c.model.num_hidden_layers,
            c.model.num_attention_heads,
            c.model.num_key_value_heads,
            c.model.intermediate_size,
            c.model.vocab_size,
            c.data.seq_len,
        )

    assert shape(m8) == (4096, 32, 32, 8, 14336, 128256, 32768)
    assert shape(m70) == (8192, 80, 64, 8, 28672, 128256, 131072)


def test_overrides_win_over_the_file():
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", "train.steps=7", "model.num_key_value_heads=1"])
    assert cfg.train.steps == 7 and cfg.model.num_key_value_heads == 1


def test_unknown_key_names_its_full_path_and_suggests_the_right_one():
    with pytest.raises(ConfigError) as err:
        load_config(["cfg=configs/tiny_cpu.yaml", "train.stepz=3"])
    assert "train.stepz" in str(err.value)
    assert "'steps'" in str(err.value)


def test_unknown_key_in_the_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"train\.stepz in .*bad\.yaml"):
        load_config([f"cfg={path}"])


def test_wrong_type_names_the_key_and_the_value():
    with pytest.raises(ConfigError, match=r"train\.steps .*'abc'.*Integer"):
        load_config(["train.steps=abc"])


def test_bad_choice_lists_the_accepted_values():
    with pytest.raises(ConfigError, match=r"cluster\.backend.*'cloud'.*\[auto, local, slurm\]"):
        load_config(["cluster.backend=cloud"])


def test_a_ulysses_size_the_heads_cannot_split_lists_the_splits_that_would():
    with pytest.raises(ConfigError) as err:
        load_config(
            [
                "parallel.sp_size=3",
                "parallel.ring_size=1",
                "cluster.tasks_per_node=3",
                "compile.enabled=true",
            ]
        )
    assert (
        "parallel.sp_size=3 / parallel.ring_size=1: the Ulysses size 3 cannot split "
        "model.num_attention_heads=4 / model.num_key_value_heads=2 over its ranks (Ulysses sizes "
        "the heads allow: 1, 2 or 4); (Ulysses x ring) splits of parallel.sp_size=3 that work: "
        "1 x 3 (parallel.ring_size=3)"
    ) in str(err.value)


def test_sp_size_past_the_head_count_is_accepted_as_ulysses_times_ring():
    args = ["cluster.tasks_per_node=8", "compile.enabled=true"]  # tiny: 4 heads, 2 KV heads
    # null is resolved as the config is loaded: Ulysses 4 (the heads) x ring 2
    assert load_config([*args, "parallel.sp_size=8"]).parallel.ulysses_ring == (4, 2)
    assert (
        load_config([*args, "parallel.sp_size=8", "parallel.ring_size=2"]).parallel.ring_size == 2
    )


def test_a_checkpoints_own_heads_decide_the_ring_not_the_yamls_shape_fields(tmp_path):
    """A pretrained model's architecture is its config.json's; the YAML's shape fields (the
    tiny default's 4 heads, 2 KV heads) are ignored, for the ring size as for the model."""
    (tmp_path / "config.json").write_text('{"num_attention_heads": 8, "num_key_value_heads": 8}')
    args = ["cluster.tasks_per_node=8", "compile.enabled=true", "parallel.sp_size=8"]
    assert load_config(args).parallel.ulysses_ring == (4, 2)  # the YAML's heads
    pretrained = [*args, f"model.pretrained_path={tmp_path}"]
    assert load_config(pretrained).parallel.ulysses_ring == (8, 1)
    (tmp_path / "config.json").write_text('{"num_attention_heads": 6, "num_key_value_heads": 2}')
    with pytest.raises(ConfigError) as err:
        load_config([*pretrained, "parallel.ring_size=1"])
    assert (
        f"the Ulysses size 8 cannot split num_attention_heads=6 / num_key_value_heads=2 of "
        f"model.pretrained_path={tmp_path} over its ranks"
    ) in str(err.value)


def test_a_signal_delay_slurm_cannot_send_is_refused():
    with pytest.raises(ConfigError, match=r"cluster\.signal_delay_s=70000 is more than SLURM"):
        load_config(["cluster.signal_delay_s=70000"])
    assert load_config(["cluster.signal_delay_s=65535"]).cluster.signal_delay_s == 65535


def test_a_ring_size_that_does_not_divide_sp_size_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config(["parallel.sp_size=2", "parallel.ring_size=4", "compile.enabled=true"])
    assert (
        "parallel.ring_size=4 does not divide parallel.sp_size=2 (sp_size = Ulysses x ring); "
        "(Ulysses x ring) splits of parallel.sp_size=2 that work: 2 x 1 (parallel.ring_size=1), "
        "1 x 2 (parallel.ring_size=2), or null to choose"
    ) in str(err.value)


def test_zero_stage_2_is_refused_naming_the_stages_that_exist():
    with pytest.raises(ConfigError) as err:
        load_config(["parallel.zero_stage=2"])
    assert (
        "parallel.zero_stage=2 is not supported; use 1 (DeepSpeed ZeRO-1), 3 (FSDP2 parameter sharding) or null"
        in str(err.value)
    )


def test_parameter_sharding_with_a_whole_model_graph_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"parallel\.zero_stage=3 with compile\.per_layer=false: .*set compile\.per_layer=true",
    ):
        load_config(["parallel.zero_stage=3", "compile.enabled=true", "compile.per_layer=false"])


def test_auto_checkpointing_refuses_settings_it_chooses_itself():
    with pytest.raises(ConfigError) as err:
        load_config(["compile.activation_memory_budget=0.5", "compile.recompute_all_to_all=true"])
    assert "compile.activation_memory_budget=0.5 applies to sac only" in str(err.value)
    assert (
        "compile.recompute_all_to_all=true: compile.activation_checkpointing=auto decides"
        in str(err.value)
    )
    load_config(
        [
            "compile.activation_checkpointing=sac",
            "compile.activation_memory_budget=0.5",
            "compile.recompute_all_to_all=true",
        ]
    )


def test_sp_size_must_divide_the_world():
    with pytest.raises(ConfigError, match=r"parallel\.sp_size=4 does not divide the world size 2"):
        load_config(["parallel.sp_size=4", "compile.enabled=true"])


def test_bf16_on_cpu_is_refused_before_submission():
    with pytest.raises(ConfigError, match=r"train\.precision=bf16 needs GPUs"):
        load_config(["train.precision=bf16"])


def test_token_source_needs_an_existing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.path=.*missing\.bin: no such file"):
        load_config(["data.source=tokens", f"data.path={tmp_path / 'missing.bin'}"])


def test_missing_config_file_is_named():
    with pytest.raises(ConfigError, match=r"cfg=nowhere\.yaml: no such file"):
        load_config(["cfg=nowhere.yaml"])


def test_argument_without_equals_sign_is_explained():
    with pytest.raises(ConfigError, match=r"'train\.steps' is not key=value"):
        load_config(["train.steps"])


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config(["train.steps=0", "train.lr=-1"])
    assert "train.steps=0 must be > 0" in str(err.value)
    assert "train.lr=-1.0 must be > 0" in str(err.value)


def test_defaults_are_the_tiny_cpu_job():
    cfg = load_config([])
    assert cfg.cluster.world_size == 2 and not cfg.cluster.uses_gpus
    assert cfg.data.source is DataSource.synthetic
    assert cfg.precision.value == "fp32"


@pytest.mark.parametrize(
    "override, named",
    [
        (
            "checkpoint.keep=0",
            "checkpoint.keep=0 must be >= 1 (keep=0 would delete every checkpoint",
        ),
        ("checkpoint.keep=-1", "checkpoint.keep=-1 must be >= 1"),
        ("checkpoint.write_gb_per_s=0", "checkpoint.write_gb_per_s=0.0 must be > 0"),
        ("data.seq_len=1", "data.seq_len=1 leaves no label to predict"),
        ("cluster.max_requeues=-1", "cluster.max_requeues=-1 must be >= 0"),
        ("cluster.mem_gb=-4", "cluster.mem_gb=-4 must be >= 0"),
        ("cluster.signal_delay_s=0", "cluster.signal_delay_s=0 must be >= 1"),
        ("cluster.collective_timeout_min=-1", "cluster.collective_timeout_min=-1.0 must be > 0"),
        ("cluster.env={A=B: 1}", "cluster.env keys ['A=B'] are not variable names"),
        ("cluster.env.MASTER_PORT=http", "cluster.env.MASTER_PORT='http' must be a port number"),
        ("cluster.env.MASTER_PORT=80", "cluster.env.MASTER_PORT='80' must be a port number"),
    ],
)
def test_values_that_would_fail_later_or_lose_data_are_refused_naming_the_key(override, named):
    with pytest.raises(ConfigError) as err:
        load_config(["cfg=configs/tiny_cpu.yaml", override])
    assert named in str(err.value)


def test_vendor_none_is_for_cpu_ranks_only():
    assert (
        load_config(["cfg=configs/tiny_cpu.yaml", "cluster.vendor=none"]).cluster.vendor.value
        == "none"
    )
    with pytest.raises(ConfigError, match=r"cluster\.vendor=none with cluster\.gpus_per_node=8"):
        load_config(["cfg=configs/tiny_cpu.yaml", "cluster.vendor=none", "cluster.gpus_per_node=8"])


def float_keys(section: type = JobConfig, prefix: str = "") -> list[str]:
    """The full key of every float field of the config, however deep."""
    keys = []
    for name, hint in typing.get_type_hints(section).items():
        if dataclasses.is_dataclass(hint):
            keys += float_keys(hint, f"{prefix}{name}.")
        elif hint in (float, float | None):
            keys.append(f"{prefix}{name}")
    return keys


@pytest.mark.parametrize("key", float_keys())
@pytest.mark.parametrize("value", ["nan", ".inf", "-.inf", "1e999"])
def test_every_float_field_refuses_nan_and_infinity_by_its_full_key(key, value):
    """No range check catches NaN (every comparison with it is false): train.lr=nan would train
    on NaN, and a NaN would only fail once the job has waited in the queue."""
    with pytest.raises(ConfigError, match=rf"\b{key}=-?(nan|inf) is not a finite number"):
        load_config(["cfg=configs/tiny_cpu.yaml", f"{key}={value}"])


def test_nan_inside_lists_and_mappings_is_refused_by_its_full_key(tmp_path):
    data = tmp_path / "tokens.bin"
    data.write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        load_config(
            [
                "cfg=configs/tiny_cpu.yaml",
                "data.source=tokens",
                f"data.blend={{{data}: .nan}}",
                "train.betas=[0.9, .nan]",
                "model.extra={attention_dropout: .inf}",
            ]
        )
    for key in (
        f"data.blend.{data}=nan",
        "train.betas[1]=nan",
        "model.extra.attention_dropout=inf",
    ):
        assert f"{key} is not a finite number" in str(err.value), err.value


def test_the_float_fields_found_include_the_ones_a_nan_would_break():
    assert {"train.lr", "train.grad_clip", "checkpoint.write_gb_per_s"} <= set(float_keys())
    assert "cluster.collective_timeout_min" in float_keys()


@pytest.mark.parametrize("name", ["../escape", "a/b", "log%j", ".", "..", "", "-rf"])
def test_run_name_must_be_a_plain_directory_name(name):
    with pytest.raises(ConfigError, match=r"run\.name=.* must be a plain directory name"):
        load_config(["cfg=configs/tiny_cpu.yaml", f"run.name='{name}'"])


def test_a_percent_sign_anywhere_in_the_run_directory_is_refused(tmp_path, monkeypatch):
    """Slurm expands %j, %u, ... in #SBATCH --output while submitit reads the literal path."""
    with pytest.raises(ConfigError, match=r"run\.output_root='.*50%done' puts '%' in the run dir"):
        load_config(["cfg=configs/tiny_cpu.yaml", f"run.output_root={tmp_path}/50%done"])
    inside = tmp_path / "proj%u"
    inside.mkdir()
    monkeypatch.chdir(inside)  # a relative run.output_root resolves under the current directory
    with pytest.raises(ConfigError, match=r"run\.output_root='runs' puts '%' in .*proj%u/runs"):
        load_config(["run.output_root=runs"])


def test_a_newline_in_any_value_rendered_into_the_job_script_is_refused(tmp_path):
    """A newline would end the #SBATCH block: the directives after it dropped, the line run as shell."""
    path = tmp_path / "evil.yaml"
    path.write_text(
        'cluster:\n  account: "proj\\n#SBATCH --foo"\n  sbatch_extra:\n    mail-user: "x\\ntouch /tmp/p"\n'
        '  srun_args: ["--x\\ty"]\n'
    )
    with pytest.raises(ConfigError) as err:
        load_config([f"cfg={path}"])
    message = str(err.value)
    for key in ("cluster.account=", "cluster.sbatch_extra.mail-user=", "cluster.srun_args[0]="):
        assert f"{key}" in message and "contains a control character" in message, message


def test_a_value_yaml_cannot_read_is_named_with_how_to_quote_it():
    with pytest.raises(
        ConfigError,
        match=r"cluster\.constraint on the command line: cannot read the value '`id`'.*quote it",
    ):
        load_config(["cfg=configs/tiny_cpu.yaml", "cluster.constraint=`id`"])


def test_a_value_yaml_would_cut_at_a_comment_is_refused_with_how_to_quote_it():
    """`run.name=exp #1` (the shell passes it whole) would silently train run `exp`."""
    with pytest.raises(
        ConfigError,
        match=r"run\.name on the command line: the value 'exp #1' would read as 'exp' .*"
        r"""comment\); quote it, e.g. run\.name='"exp #1"'""",
    ):
        load_config(["cfg=configs/tiny_cpu.yaml", "run.name=exp #1"])
    assert load_config(["run.name='exp #1'"]).run.name == "exp #1"
    assert load_config(["run.name=exp#1"]).run.name == "exp#1"  # no space: not a comment


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model.lora.dropout=0.1"],
            "model.lora.dropout=0.1 with parallel.sp_size=2: each rank would draw its own dropout",
        ),
        (["model.lora.rank=0"], "model.lora.rank=0 must be > 0"),
        (["model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
    ],
)
def test_lora_settings_sp_cannot_train_or_that_adapt_nothing_are_refused_by_key(overrides, message):
    """LoRA dropout at SP > 1 (each rank would draw its own masks for its part of the sequence),
    a rank of 0 and an empty list of adapted layers: refused at config time, naming the key."""
    with pytest.raises(ConfigError) as err:
        load_config(
            ["cfg=configs/tiny_cpu.yaml", "parallel.sp_size=2", "model.lora={}", *overrides]
        )
    assert message in str(err.value)


def test_lora_dropout_is_accepted_without_sp():
    cfg = load_config(
        [
            "cfg=configs/tiny_cpu.yaml",
            "parallel.sp_size=1",
            "model.lora={}",
            "model.lora.dropout=0.1",
        ]
    )
    assert cfg.model.lora.dropout == 0.1
