"""The staging buffer: trees staged by a rank and rebuilt by the writer from its own mapping
write the bytes torch.save writes of the originals; the buffer is kept and grown, not remade."""

import io
import mmap
import pickle
from collections import OrderedDict

import torch
from saved_on_device import saved_on
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from slurm_autosp.checkpoint.staging_buffer import StagingBuffer, unstage
from slurm_autosp.checkpoint.state_files import StateFiles


def saved_bytes(tree):
    buffer = io.BytesIO()
    torch.save(tree, buffer)
    return buffer.getvalue()


def trees():
    """What checkpoints hold: a module's state dict (an OrderedDict with `_metadata`), views of
    one storage, a parameter, bf16, an empty tensor, a transposed view, scalars and strings."""
    base = torch.arange(24, dtype=torch.float32)
    state = OrderedDict(weight=torch.randn(3, 4), bias=torch.zeros(0))
    state._metadata = OrderedDict({"": {"version": 2}})  # type: ignore[attr-defined]
    return {
        "module.pt": state,
        "pieces.pt": {
            "views": [base[:8], base[8:].view(4, 4).t(), base],
            "master": nn.Parameter(torch.randn(5)),
            "moments": (torch.randn(7, dtype=torch.bfloat16), torch.ones(2, requires_grad=True)),
            "step": 3,
            "name": "adamw",
        },
    }


def written_by_the_writer(files, buffer_path):
    """`files` as the writer process gets them (pickled) and writes them (unstaged)."""
    staged = pickle.loads(pickle.dumps(files))
    with open(buffer_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as memory:
        rebuilt = unstage(staged, memory)
        written = {name: saved_bytes(tree) for name, tree in rebuilt.trees.items()}
        del rebuilt
    return written


def test_staged_trees_are_written_as_torch_save_writes_the_originals(tmp_path):
    originals = StateFiles(trees(), {"index.json": "{}"})
    buffer = StagingBuffer(tmp_path / "buffer")
    try:
        staged = buffer.stage(buffer.place(originals))
        written = written_by_the_writer(staged, buffer.path)
    finally:
        buffer.close()
    assert staged.texts == originals.texts
    assert written == {name: saved_bytes(tree) for name, tree in originals.trees.items()}
    loaded = torch.load(io.BytesIO(written["pieces.pt"]), weights_only=False)
    first, transposed, whole = loaded["views"]
    assert first.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert torch.equal(transposed, torch.arange(8, 24.0).view(4, 4).t())
    assert isinstance(loaded["master"], nn.Parameter)
    assert torch.load(io.BytesIO(written["module.pt"]))._metadata == {"": {"version": 2}}


def test_a_staged_save_restored_by_its_rank_writes_what_the_originals_write(tmp_path):
    """Where its asynchronous write failed, the rank writes the staged copy itself: each tree
    a view of the buffer, each storage on its own (not the whole buffer's)."""
    originals = StateFiles(trees(), {"index.json": "{}"})
    buffer = StagingBuffer(tmp_path / "buffer")
    try:
        restored = buffer.restore(buffer.stage(buffer.place(originals)))
        written = {name: saved_bytes(tree) for name, tree in restored.trees.items()}
    finally:
        buffer.close()
    assert restored.texts == originals.texts
    assert written == {name: saved_bytes(tree) for name, tree in originals.trees.items()}


def test_a_synchronous_save_of_a_gpus_tensors_writes_what_the_staged_one_writes(tmp_path):
    """torch.save records a GPU tensor's device, where torch.load without map_location puts it
    back: a synchronous save of GPU state wrote other bytes than the staged host copy, and every
    rank that loaded them made a CUDA context on the GPU that wrote them."""
    originals = StateFiles(trees())
    with saved_on("cuda:0"):
        originals.write(tmp_path)
        assert b"cuda:0" in saved_bytes(originals.trees["pieces.pt"])
    for name, tree in originals.trees.items():
        assert (tmp_path / name).read_bytes() == saved_bytes(tree), name  # the staged save's


def test_the_buffer_is_kept_between_saves_and_grows_when_a_save_needs_more(tmp_path):
    buffer = StagingBuffer(tmp_path / "buffer")
    small = StateFiles({"a.pt": torch.randn(1000)})
    large = StateFiles({"a.pt": torch.randn(100_000)})
    try:
        buffer.stage(buffer.place(small))
        kept = buffer.path.stat()
        buffer.stage(buffer.place(small))
        assert buffer.path.stat().st_ino == kept.st_ino
        buffer.stage(buffer.place(large))
        grown = buffer.path.stat().st_size
        assert grown >= 400_000 > kept.st_size
        staged = buffer.stage(buffer.place(small))  # a smaller save reuses the grown buffer
        assert buffer.path.stat().st_size == grown
        assert written_by_the_writer(staged, buffer.path) == {
            "a.pt": saved_bytes(small.trees["a.pt"])
        }
    finally:
        buffer.close()


def test_a_dtensor_of_a_gpu_mesh_is_written_from_its_shard_in_the_buffer(
    tmp_path, single_rank_group
):
    """FSDP2's state on a GPU node: DTensors of a CUDA mesh. Their staged views keep each shard
    in the host buffer, under the same mesh, placements and shape, for the distributed
    checkpoint to write from (DTensor.from_local would copy it back to the mesh's device; on
    this machine, which has none, it raises). The mesh is a CUDA one made without its backend:
    the stand-in for the device."""
    gpu_mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
    on_host = DTensor.from_local(
        torch.arange(12.0).view(4, 3), DeviceMesh("cpu", torch.arange(1)), [Shard(0)]
    )
    shard = DTensorSpec(gpu_mesh, on_host.placements, on_host._spec.tensor_meta)
    state = {
        "model": {"w": DTensor(on_host.to_local(), shard, requires_grad=False)},
        "step": torch.tensor(3),
    }
    buffer = StagingBuffer(tmp_path / "buffer")
    try:
        staged = buffer.stage(buffer.place(StateFiles(distributed={"": state})))
        written = buffer.views(staged.distributed)[""]
        w = written["model"]["w"]
        assert (w.device_mesh.device_type, w.placements, w.shape) == ("cuda", (Shard(0),), (4, 3))
        local = w.to_local()
        assert local.device.type == "cpu" and torch.equal(local, torch.arange(12.0).view(4, 3))
        memory = buffer._memory
        assert memory.data_ptr() <= local.data_ptr() < memory.data_ptr() + memory.numel()
        assert torch.equal(written["step"], torch.tensor(3))
    finally:
        buffer.close()
