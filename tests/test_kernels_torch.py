"""The compiled selection kernels against the torch compositions they replace."""
import pytest
import torch

from horovod_dgc.core.ops import TensorOps
from horovod_dgc.torch import kernels
from horovod_dgc.torch.ops import TorchOps


def reference(x: torch.Tensor, block: int) -> torch.Tensor:
    rows = x[:x.numel() // block * block].view(-1, block)
    return torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg())


@pytest.mark.parametrize("numel", [0, 7, 64, 1000, 4099])
@pytest.mark.parametrize("block", [1, 8, 17, 64, 1024])
def test_matches_reference(numel, block):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + block))
    assert torch.equal(kernels.block_abs_max(x, block), reference(x, block))


def test_ranges_split_across_threads_cover_every_block():
    x = torch.randn(kernels.PARALLEL_MIN_NUMEL * 3 + 100, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        for width in (1, 2, 3):
            torch.set_num_threads(width)
            assert torch.equal(kernels.block_abs_max(x, 64), reference(x, 64))
    finally:
        torch.set_num_threads(threads)


def test_nan_propagates_like_amax():
    x = torch.randn(256)
    x[70] = float("nan")
    maxima = kernels.block_abs_max(x, 64)
    assert torch.isnan(maxima[1]) and not torch.isnan(maxima[[0, 2, 3]]).any()


def test_rejects_other_dtypes_and_layouts():
    with pytest.raises(TypeError, match="float32"):
        kernels.block_abs_max(torch.randn(64, dtype=torch.float64), 8)
    with pytest.raises(TypeError, match="contiguous"):
        kernels.block_abs_max(torch.randn(128)[::2], 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_ops_block_abs_max_includes_the_partial_last_block(dtype):
    x = torch.randn(1000, dtype=dtype)
    expected = torch.cat([reference(x, 64), x[960:].abs().amax().reshape(1)])
    assert torch.equal(TorchOps().block_abs_max(x, 64), expected)


@pytest.mark.parametrize("numel,block", [(1000, 64), (1024, 64), (37, 8), (5000, 1)])
@pytest.mark.parametrize("threshold", [0.0, 1.5, 3.0, 100.0])
def test_collect_matches_the_core_composition(numel, block, threshold):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[3] = float("nan")
    n_blocks = -(-numel // block)
    blocks = torch.arange(0, n_blocks, 3, dtype=torch.int64)
    blocks = torch.cat([blocks, torch.tensor([n_blocks - 1])]).unique()
    expected = TensorOps.collect_at_least(TorchOps(), x, blocks, block, torch.tensor(threshold))
    got = kernels.collect_at_least(x, blocks, block, threshold)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_collect_refuses_a_block_outside_the_tensor():
    with pytest.raises(IndexError, match="block 2 of a tensor of 2 blocks"):
        kernels.collect_at_least(torch.randn(100), torch.tensor([0, 2]), 64, 0.5)
