"""The GPU's one-kernel memory pass (``kernels/triton_memory.py``) against the equations
written out here in float64: DGC's momentum correction (plain and Nesterov) and error
feedback, the block maxima of the new memory (short last block included), the finiteness flag.

On a CUDA device the kernel runs as TorchOps runs it; and on every machine with Triton, the
same tests run again in a child process under Triton's interpreter on CPU tensors, so the
kernel's indexing and masking are checked without a GPU too.
"""
import math

import pytest
import torch
from conftest import TRITON_DEVICE, check_under_the_triton_interpreter, runs_on_the_triton_device

pytest.importorskip("triton")

from horovod_dgc.torch.kernels import triton_memory  # noqa: E402
from horovod_dgc.torch.ops import TorchOps  # noqa: E402

# In a process started with TRITON_INTERPRET=1 (see the last test) the kernel runs on CPU tensors.
DEVICE, runs_here = TRITON_DEVICE, runs_on_the_triton_device


def reference(grad, scale, velocity, block, momentum=None, m=0.0, nesterov=False):
    """The pass written as the paper's equations, in float64, and the block maxima by a loop."""
    g, v = grad.double().reshape(-1) * scale, velocity.double()
    u = None
    if momentum is None:
        v = v + g
    elif nesterov:
        u = m * (momentum.double() + g)
        v = v + u + g
    else:
        u = m * momentum.double() + g
        v = v + u
    maxima = None
    if block:
        maxima = torch.tensor([v[start:start + block].abs().max().item()
                               for start in range(0, v.numel(), block)], dtype=torch.float64)
    return u, v, maxima


@pytest.mark.parametrize("numel,block", [(4096, 64), (4097, 64), (1000, 16), (5, 64), (3000, 0)])
@pytest.mark.parametrize("variant", ["error-feedback", "momentum", "nesterov"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@runs_here
def test_one_pass_follows_the_equations(numel, block, variant, grad_dtype):
    module, device = triton_memory, DEVICE
    gen = torch.Generator().manual_seed(numel + block)
    grad = torch.randn(numel, generator=gen).to(grad_dtype).to(device)
    velocity = torch.randn(numel, generator=gen).to(device)
    momentum = None if variant == "error-feedback" else torch.randn(numel, generator=gen).to(device)
    m, nesterov = 0.9, variant == "nesterov"
    u, v, maxima, finite = module.memory_pass(grad, 0.5, velocity, None, block, momentum, None, m, nesterov)
    ru, rv, rmax = reference(grad.cpu(), 0.5, velocity.cpu(), block,
                             None if momentum is None else momentum.cpu(), m, nesterov)
    close = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v.cpu().double(), rv, **close)
    if ru is None:
        assert u is None
    else:
        torch.testing.assert_close(u.cpu().double(), ru, **close)
    if block:
        assert maxima.shape == (math.ceil(numel / block),)
        torch.testing.assert_close(maxima.cpu().double(), rmax, **close)
    else:
        assert maxima is None
    assert finite.dtype == torch.bool and finite.shape == () and bool(finite)


@runs_here
def test_new_memories_go_where_they_are_asked_to():
    module, device = triton_memory, DEVICE
    grad, velocity, momentum = (torch.full((300,), x, device=device) for x in (1.0, 2.0, 3.0))
    u, v, _, _ = module.memory_pass(grad, 1.0, velocity, velocity, 64, momentum, momentum, 0.5)
    assert u.data_ptr() == momentum.data_ptr() and v.data_ptr() == velocity.data_ptr()
    assert torch.all(momentum == 2.5) and torch.all(velocity == 4.5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 2047, 2048, 4999])
@runs_here
def test_a_non_finite_entry_anywhere_clears_the_flag(bad, where):
    module, device = triton_memory, DEVICE
    grad = torch.ones(5000, device=device)
    grad[where] = bad
    assert not bool(module.memory_pass(grad, 1.0, torch.zeros(5000, device=device), None, 64)[3])
    # Finite, but its sum in float16 would overflow: the flag is per entry, not from a sum.
    big = torch.full((5000,), 60000.0, dtype=torch.float16, device=device)
    assert bool(module.memory_pass(big, 1.0, torch.zeros(5000, device=device), None, 64)[3])


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="no CUDA device")
def test_torch_ops_take_the_kernel_for_cuda_tensors_only_where_it_applies(monkeypatch):
    calls = []
    real = triton_memory.memory_pass
    monkeypatch.setattr(triton_memory, "memory_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    ops, grad = TorchOps(), torch.randn(4096, device="cuda")
    memory = torch.zeros(4096, device="cuda")
    ops.momentum_accumulate(memory, memory.clone(), grad, 0.9, 1.0, False, block=64)
    ops.accumulate(memory, grad, 1.0, block=64, stat="max")
    assert len(calls) == 2
    ops.accumulate(memory, grad, torch.tensor(0.5, device="cuda"), block=64, stat="max")
    ops.accumulate(memory, grad, 1.0, block=64, stat="sum")
    ops.accumulate(memory.cpu(), grad.cpu(), 1.0, block=64, stat="max")
    assert len(calls) == 2


@pytest.mark.skipif(triton_memory.INTERPRETED, reason="this is the interpreted run")
def test_the_kernel_under_the_interpreter_on_cpu_tensors():
    """This file's kernel tests again in a process where Triton interprets kernels on the CPU
    (Triton reads the switch when it is imported, so it takes a process of its own)."""
    check_under_the_triton_interpreter(__file__)
