"""Misuse is refused with a clear error on every rank: momentum applied twice (stock path),
a compressor without named_parameters, and the own path moving SGD's momentum over."""
import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc


def expect_error(fn, needle: str) -> None:
    try:
        fn()
    except ValueError as error:
        assert needle in str(error), str(error)
        return
    raise AssertionError(f"no ValueError mentioning {needle!r}")


def one_step(optimizer, net) -> None:
    optimizer.zero_grad()
    net(torch.randn(4, 64)).sum().backward()
    optimizer.step()


def double_momentum() -> None:
    net = torch.nn.Linear(64, 64)
    compression = hdgc.Compression.dgc(named_parameters=net.named_parameters())
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(sgd, named_parameters=net.named_parameters(), compression=compression)
    expect_error(lambda: one_step(optimizer, net), "momentum=0.9")


def missing_named_parameters() -> None:
    net = torch.nn.Linear(64, 64)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         named_parameters=net.named_parameters(),
                                         compression=hdgc.Compression.topk())
    expect_error(lambda: one_step(optimizer, net), "named_parameters")


def own_path_moves_momentum() -> None:
    net = torch.nn.Linear(64, 64)
    compression = hdgc.Compression.dgc()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.8, nesterov=True, weight_decay=1e-4)
    optimizer = hdgc.DistributedOptimizer(sgd, named_parameters=net.named_parameters(), compression=compression)
    assert compression.config.momentum == 0.8 and compression.config.nesterov
    assert compression.config.weight_decay == 1e-4
    assert all(g["momentum"] == 0 and g["weight_decay"] == 0 for g in optimizer.param_groups)
    one_step(optimizer, net)


if __name__ == "__main__":
    hvd.init()
    double_momentum()
    missing_named_parameters()
    own_path_moves_momentum()
    print(f"rank {hvd.rank()} misuse ok", flush=True)
