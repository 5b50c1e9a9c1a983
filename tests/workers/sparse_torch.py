"""Sparse gradients (``nn.Embedding(sparse=True)``) on real ranks. Without
``sparse_as_dense`` our fused optimizer refuses one at the first backward pass, naming the
parameter (it used to fail inside torch: "reshape is not implemented for sparse tensors"),
and under the stock optimizer, which sends it uncompressed by an allgather of its own, the
compressor warns once, naming it.
With it, for dgc and topk, 6 steps give the parameters of the stock
``hvd.DistributedOptimizer(sparse_as_dense=True)`` with the same compressor, and those of the
same model with a dense embedding on the fused path (within 1e-6): the gradient is made dense,
then compressed like any other.
"""
import warnings

import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc

STEPS = 6
VOCABULARY, WIDTH, TOKENS = 1000, 16, 4  # the embedding (16,000 entries) is compressed


def net(sparse: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCABULARY, WIDTH, sparse=sparse), torch.nn.Flatten(),
                               torch.nn.Linear(WIDTH * TOKENS, 3))


def train(method: str, path: str, sparse: bool, sparse_as_dense: bool = True) -> torch.Tensor:
    model = net(sparse)
    compression = getattr(hdgc.Compression, method)(named_parameters=model.named_parameters(), density=0.01)
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=model.named_parameters(),
                     compression=compression, sparse_as_dense=sparse_as_dense)
    compression.set_epoch(0)
    for step in range(STEPS):
        tokens = torch.randint(VOCABULARY, (8, TOKENS), generator=torch.Generator().manual_seed(100 * step + hvd.rank()))
        optimizer.zero_grad()
        model(tokens).pow(2).mean().backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def refused_without_sparse_as_dense() -> None:
    try:
        train("dgc", "own", sparse=True, sparse_as_dense=False)
    except ValueError as error:
        assert "'0.weight' has a sparse gradient" in str(error) and "sparse_as_dense=True" in str(error), error
    else:
        raise AssertionError("a sparse gradient was taken without sparse_as_dense")


def stock_path_warns_without_sparse_as_dense() -> None:
    """Horovod's stock optimizer sends a sparse gradient by its own allgather, never through
    compress(): the compressor says so, naming the parameter, instead of staying silent."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train("dgc", "stock", sparse=True, sparse_as_dense=False)
    said = [str(w.message) for w in caught if "bypass the compressor" in str(w.message)]
    assert len(said) == 1 and "'0.weight'" in said[0], [str(w.message) for w in caught]


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    refused_without_sparse_as_dense()
    stock_path_warns_without_sparse_as_dense()
    initial = torch.cat([p.detach().reshape(-1) for p in net(True).parameters()])
    for method in ("dgc", "topk"):
        fused = train(method, "own", sparse=True)
        stock = train(method, "stock", sparse=True)
        dense = train(method, "own", sparse=False)
        assert float((fused - initial).abs().max()) > 0.01, f"{method}: nothing moved"
        for label, other in (("stock", stock), ("dense embedding", dense)):
            difference = float((fused - other).abs().max())
            assert difference <= 1e-6, f"{method}: fused sparse_as_dense and {label} differ by {difference}"
        print(f"rank {hvd.rank()} {method} sparse_as_dense ok", flush=True)
