"""Blocksign's sign kernels (``kernels/triton_signs.py``) against loops written here from
the method's definitions: bit ``i % 8`` of byte ``i // 8`` set where entry i is at least 0
(padding past the buffer is 0: set), the residual ``x_i - s * sign(x_i)`` with s the scale
of i's block, and the decode ``s * (+1 or -1)`` added to a sum where one is given; then a
blocksign bucket through the kernels against the paper's per-tensor equations.

As ``test_triton_bits.py``: on a CUDA device the kernels run on CUDA tensors, and on every
machine with Triton the same tests run again in a child process under Triton's interpreter.
"""
import random

import pytest
import torch
from conftest import TRITON_DEVICE, check_under_the_triton_interpreter, runs_on_the_triton_device

pytest.importorskip("triton")

from horovod_dgc.torch.kernels import triton_memory, triton_signs  # noqa: E402
from horovod_dgc.torch.ops import TorchOps  # noqa: E402

DEVICE, runs_here = TRITON_DEVICE, runs_on_the_triton_device


@pytest.mark.parametrize("n,block,padding_bytes", [(1, 1, 0), (37, 5, 2), (5000, 64, 0), (4099, 16, 1)])
@runs_here
def test_signs_are_packed_and_the_residual_keeps_what_they_do_not_say(n, block, padding_bytes):
    rng = random.Random(n)
    values = [rng.choice([0.0, -0.0, float("nan"), rng.gauss(0, 1)]) if i % 7 == 0 else rng.gauss(0, 1)
              for i in range(n)]
    scales = [abs(rng.gauss(0, 1)) for _ in range(-(-n // block))]
    values, scales = (torch.tensor(v, dtype=torch.float32).tolist() for v in (values, scales))  # as sent
    length = (-(-n // 8) + padding_bytes) * 8
    x = torch.tensor(values, dtype=torch.float32, device=DEVICE)
    packed, residual = triton_signs.sign_compress(x, torch.tensor(scales, device=DEVICE), block, length)
    bits = [1 if i >= n or values[i] >= 0 else 0 for i in range(length)]  # NaN >= 0 is False
    want_bytes = [sum(bits[8 * b + j] << j for j in range(8)) for b in range(length // 8)]
    assert packed.cpu().tolist() == want_bytes
    want = torch.tensor([v - (scales[i // block] if bits[i] else -scales[i // block]) for i, v in enumerate(values)],
                        dtype=torch.float32)
    assert torch.equal(residual.cpu().isnan(), want.isnan())
    assert torch.equal(residual.cpu().nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("added", [False, True])
@pytest.mark.parametrize("n,block", [(1, 1), (61, 3), (5000, 8), (4099, 100)])
@runs_here
def test_packed_signs_decode_to_their_blocks_scales(n, block, added):
    rng = random.Random(n + block)
    data = [rng.randrange(256) for _ in range(-(-n // 8))]
    scales = torch.tensor([rng.gauss(0, 1) for _ in range(-(-n // block))]).tolist()
    total = torch.tensor([rng.gauss(0, 1) for _ in range(n)]).tolist()
    add_to = torch.tensor(total, device=DEVICE) if added else None
    got = triton_signs.sign_decode(torch.tensor(data, dtype=torch.uint8, device=DEVICE),
                                   torch.tensor(scales, device=DEVICE), block, n, add_to)
    signed = [scales[i // block] * (1.0 if data[i // 8] >> (i % 8) & 1 else -1.0) for i in range(n)]
    want = [t + s for t, s in zip(total, signed)] if added else signed
    assert got.cpu().tolist() == torch.tensor(want, dtype=torch.float32).tolist()
    if added:
        assert got.data_ptr() == add_to.data_ptr()  # the sum written over


@pytest.mark.skipif(not triton_memory.INTERPRETED, reason="the engines' tensors are on the CPU")
@pytest.mark.parametrize("world,block,mu", [(3, None, 0.9), (2, 16, 0.0)])
def test_a_blocksign_bucket_through_the_kernels_runs_each_tensor_as_the_paper_says(world, block, mu, monkeypatch):
    from test_core_bucket import test_a_blocksign_bucket_runs_each_tensor_as_the_paper_says as check
    monkeypatch.setattr(TorchOps, "sizes_cost_a_wait", lambda self, x: True)
    calls = []
    for name in ("sign_compress", "sign_decode"):
        kernel = getattr(triton_signs, name)
        monkeypatch.setattr(triton_signs, name, lambda *a, _kernel=kernel, _name=name: calls.append(_name) or _kernel(*a))
    check(world, block, mu)
    assert set(calls) == {"sign_compress", "sign_decode"}


@pytest.mark.skipif(triton_memory.INTERPRETED, reason="this is the interpreted run")
def test_the_kernels_under_the_interpreter_on_cpu_tensors():
    """This file's kernel tests again where Triton interprets kernels on the CPU (a process
    of its own: Triton reads the switch when it is imported)."""
    check_under_the_triton_interpreter(__file__)
