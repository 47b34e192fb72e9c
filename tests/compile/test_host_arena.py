"""The host memory activation offload holds is the bytes it offloads, reused micro-batch after
micro-batch: torch's pinned allocator would round each tensor up to a power of two and cache
it, up to twice what the memory plan counts."""

import subprocess
import sys
from pathlib import Path

import torch

from slurm_autosp.sp.host_arena import HostArena

MiB = 1 << 20


def saved(shape, dtype=torch.float32, permute=None):
    tensor = torch.randn(shape).to(dtype)
    return tensor.permute(*permute) if permute else tensor


def test_a_session_takes_what_it_stores_plus_at_most_one_slabs_tail():
    arena = HostArena(pin=False, slab_bytes=8 * MiB)
    session = arena.session()
    # 3 MiB, 1 MiB and 7 bytes, 2 MiB: one slab
    tensors = [saved((3 * MiB // 4,)), saved((MiB + 7,), torch.uint8), saved((MiB // 2,))]
    hosts = [session.empty_like(t) for t in tensors]
    assert arena.reserved_bytes == 8 * MiB
    big = saved((4 * MiB,))  # 16 MiB: larger than a slab, a slab of its own at its exact size
    hosts.append(session.empty_like(big))
    assert arena.reserved_bytes == 8 * MiB + 16 * MiB
    for tensor, host in zip([*tensors, big], hosts, strict=True):
        assert (host.shape, host.stride(), host.dtype) == (
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
        )
        assert host.data_ptr() % 64 == 0  # the host allocator aligns slabs to 64 bytes
        host.copy_(tensor)
    for tensor, host in zip([*tensors, big], hosts, strict=True):
        assert torch.equal(host, tensor)  # no two share memory


def test_the_next_micro_batch_reuses_the_slabs_and_concurrent_ones_take_their_own():
    arena = HostArena(pin=False, slab_bytes=4 * MiB)
    shapes = [(MiB // 4,), (MiB // 2,), (2 * MiB,)]  # 1, 2 and 8 MiB of float32

    def forward(session):
        return [session.empty_like(saved(s)) for s in shapes]

    first = arena.session()
    forward(first)
    reserved = arena.reserved_bytes
    assert reserved == 4 * MiB + 8 * MiB
    first.release()
    for _ in range(3):
        again = arena.session()
        forward(again)
        again.release()
    assert arena.reserved_bytes == reserved
    live = [arena.session(), arena.session()]  # two micro-batches' activations at once
    for session in live:
        forward(session)
    assert arena.reserved_bytes == 2 * reserved


def test_a_session_dropped_unread_returns_its_slabs():
    arena = HostArena(pin=False, slab_bytes=4 * MiB)
    session = arena.session()
    session.empty_like(saved((MiB // 4,)))
    del session
    arena.session().empty_like(saved((MiB // 4,)))
    assert arena.reserved_bytes == 4 * MiB


def test_a_permuted_dense_tensor_keeps_its_strides():
    arena = HostArena(pin=False, slab_bytes=MiB)
    tensor = saved((2, 3, 64, 8), permute=(0, 2, 1, 3))  # [B, S, H, D] view of [B, H, S, D]
    host = arena.session().empty_like(tensor)
    assert host.stride() == tensor.stride()
    host.copy_(tensor)
    assert torch.equal(host, tensor)


def test_a_pinned_slab_is_unpinned_when_freed_but_not_at_interpreter_exit():
    """cudaHostUnregister at exit may run after the CUDA context is gone: the process's end
    unpins its memory anyway. The CUDA runtime's two calls are stood in for by recorders (no
    GPU here); the arena's own finalizers decide when they run."""
    script = (
        "import gc\n"
        "from slurm_autosp.compat import torch_api\n"
        "from slurm_autosp.sp.host_arena import HostArena\n"
        "torch_api.register_pinned = lambda ptr, size: print('pinned', flush=True)\n"
        "torch_api.unregister_pinned = lambda ptr: print('unpinned', flush=True)\n"
        "arena = HostArena(pin=True, slab_bytes=4096)\n"
        "freed = arena.take_slab(16)\n"
        "kept = arena.take_slab(16)\n"
        "del freed\n"
        "gc.collect()\n"
        "print('exiting', flush=True)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
    )
    assert ran.stdout.split() == ["pinned", "pinned", "unpinned", "exiting"]
