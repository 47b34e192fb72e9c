"""slurm_autosp.compat: every private submitit, torch and DeepSpeed name slurm_autosp uses still exists
upstream, with the parameters it passes; an upgrade that renames or removes one fails here."""

import importlib
import inspect
import os

import deepspeed.ops
import pytest
import submitit
import torch
import torch._inductor.runtime.cache_dir_utils as inductor_cache_dir_utils
from deepspeed.accelerator import get_accelerator
from deepspeed.comm.torch import build_shm_op

from slurm_autosp.compat import deepspeed_api, submitit_api, torch_api
from slurm_autosp.config import Precision, load_config
from slurm_autosp.engine import build_engine
from slurm_autosp.launch.executor import sbatch_script


def test_submitit_requeue_takes_a_countdown():
    assert list(inspect.signature(submitit.JobEnvironment._requeue).parameters) == [
        "self",
        "countdown",
    ]


def test_submitit_slurm_rendering_names_exist():
    assert callable(submitit.SlurmExecutor._convert_parameters)
    assert "uid" in inspect.signature(submitit.SlurmExecutor._make_submission_file_text).parameters
    assert hasattr(submitit.SlurmExecutor, "_submitit_command_str")


def test_sbatch_text_renders_through_compat():
    script = sbatch_script(load_config(["cfg=configs/llama70b_128k.yaml"]))
    assert script.startswith("#!/bin/bash") and "#SBATCH --nodes=" in script


def test_pickle_load_reads_submitit_result_pickles(tmp_path):
    path = tmp_path / "result.pkl"
    submitit.core.utils.cloudpickle_dump(("success", 42), path)
    assert submitit_api.pickle_load(path) == ("success", 42)


def test_inductor_default_cache_dir_is_what_importing_dynamo_exports(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert torch_api.inductor_default_cache_dir() == inductor_cache_dir_utils.cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == torch_api.inductor_default_cache_dir()


def test_torch_dynamo_and_inductor_settings_we_set_exist():
    assert hasattr(torch_api.dynamo_config, "fail_on_recompile_limit_hit")
    assert hasattr(torch_api.dynamo_config, "recompile_limit")
    from torch._inductor import config as inductor_config

    assert hasattr(inductor_config, "joint_custom_post_pass") and callable(inductor_config.patch)
    assert {"uuid", "__call__"} <= set(dir(torch_api.CustomGraphPass))


@pytest.mark.parametrize(
    ("module", "name"),
    [  # used by plan.layer_graph and plan.memory to trace one decoder layer's joint graph
        ("torch._functorch.aot_autograd", "aot_module_simplified"),
        ("torch._inductor.compile_fx", "compile_fx"),
        ("torch._inductor.compile_fx", "partition_fn"),
        ("torch._inductor.decomposition", "select_decomp_table"),
        ("torch._subclasses.fake_tensor", "FakeTensorMode"),
        ("torch._prims.rng_prims", "run_with_rng_state"),
        ("torch._prims.rng_prims", "run_and_save_rng_state"),
        ("torch._ops", "OpOverload"),
        ("torch._dynamo", "maybe_mark_dynamic"),  # compile.inputs: packed rows' document count
        ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),  # engine.fsdp2
        ("torch.distributed.distributed_c10d", "_abort_process_group"),  # a failed rank's exit
    ],
)
def test_private_torch_names_still_exist(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone"


def test_deepspeed_builds_no_shared_memory_op_once_skipped(monkeypatch):
    """The op's name is the one DeepSpeed's CPU builder uses, and once skipped its comm backend
    gets no op (were the name stale, this would JIT-build it and return it)."""
    builder = get_accelerator().create_op_builder(deepspeed_api.SHARED_MEMORY_COMM_BUILDER)
    assert builder.NAME == deepspeed_api.SHARED_MEMORY_COMM_OP
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, builder.NAME, True)
    deepspeed_api.skip_shared_memory_comm_build()
    assert build_shm_op() is None


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deepspeed_zero1_links_each_parameter_to_its_piece_of_the_flat_fp32_partition(
    precision, single_rank_group, tmp_path
):
    """What ZeroPartition reads of DeepSpeed's ZeRO optimizer (fp32) and BF16_Optimizer (bf16):
    on one rank every parameter is one whole piece of its group's flat partition, in order;
    update_lp_params copies the masters into the module's weights; and DeepSpeed's own
    checkpoint names its optimizer files as own_format_ranks counts them."""
    cfg = load_config(["cluster.tasks_per_node=1", "model.num_hidden_layers=1"])
    cfg.train.precision = Precision(precision)  # bf16 on CPU ranks: tests only
    engine = build_engine(cfg, torch.device("cpu"), zero_stage=1)
    partition = deepspeed_api.ZeroPartition(engine._engine.optimizer)
    (flat,) = partition.flat_partitions()
    assert flat.dtype == torch.float32 and partition.optimizer.param_groups[0]["params"] == [flat]
    offset = 0
    for param in engine.module.parameters():
        piece = deepspeed_api.Fragment(group=0, start=0, numel=param.numel(), offset=offset)
        assert partition.fragment(param) == piece
        offset += param.numel()
    assert flat.numel() >= offset
    with torch.no_grad():
        flat.fill_(0.5)
    partition.update_lp_params()
    assert all(torch.all(p == 0.5) for p in engine.module.parameters())
    engine._engine.save_checkpoint(str(tmp_path), tag="own", save_latest=False)
    assert partition.own_format_ranks(tmp_path / "own") == 1
    engine.close()


def test_flash_varlen_ops_take_the_arguments_document_attention_passes():
    """document_attention's CUDA kernel calls them positionally up to is_causal (forward) and
    unused (backward), then by keyword: an upgrade that moves or renames one fails here."""
    forward = [a.name for a in torch_api.flash_attention_forward._schema.arguments]
    backward = [a.name for a in torch_api.flash_attention_backward._schema.arguments]
    assert forward[:10] == [
        "query",
        "key",
        "value",
        "cum_seq_q",
        "cum_seq_k",
        "max_q",
        "max_k",
        "dropout_p",
        "is_causal",
        "return_debug_mask",
    ]
    assert backward[:14] == [
        "grad_out",
        "query",
        "key",
        "value",
        "out",
        "logsumexp",
        "cum_seq_q",
        "cum_seq_k",
        "max_q",
        "max_k",
        "dropout_p",
        "is_causal",
        "rng_state",
        "unused",
    ]
    for names in (forward, backward):
        assert {"scale", "window_size_left", "window_size_right"} <= set(names)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_wrapped_module_call_runs_the_wrapper_around_what_the_call_ran(compiled):
    layer = torch.nn.Linear(4, 4)
    if compiled:
        layer.compile(backend="eager")
    seen = []

    def around(call):
        def wrapped(*args, **kwargs):
            seen.append("before")
            return call(*args, **kwargs)

        return wrapped

    torch_api.wrap_module_call(layer, around)
    x = torch.randn(2, 4)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert seen == ["before"]
