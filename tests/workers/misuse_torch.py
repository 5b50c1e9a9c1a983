"""Misuse is refused with a clear error on every rank: momentum applied twice (stock path)
and the own path moving SGD's momentum over (a dampening refused, another Nesterov flag
warned of), with a weight decay per param group; a second synchronize() before step() sends
nothing again; a parameter frozen when the fused optimizer was built and unfrozen later is
refused by name (nothing would average its gradient), and so is one added by add_param_group;
a scheduler that cycles momentum is refused on both paths (DGC's momentum applied twice), and
so is a GradScaler the compressor was not given (memories in scaled units) or one stepping the
optimizer before the gradients are averaged (PyTorch's recipe, not Horovod's); Horovod's
Adasum optimizer, which hands the compressor parameter changes, is refused naming the op."""
import warnings

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
    launched_nothing(compression)


def launched_nothing(compression) -> None:
    """A refusal on the stock path comes before the step launches a collective: one left in
    flight would collide with the next optimizer's under the same parameter names."""
    assert compression.stats().bytes_sent == 0, compression.stats()


def weight_decay_left_outside_the_momentum() -> None:
    """Stock path, DGC keeping the momentum: an SGD weight decay would act outside it (torch's
    SGD adds it before its momentum), 10x weaker at momentum 0.9; refused with the numbers.
    The same decay given to the compressor trains."""
    net = torch.nn.Linear(64, 64)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=1e-4)
    compression = hdgc.Compression.dgc()
    optimizer = hvd.DistributedOptimizer(sgd, named_parameters=net.named_parameters(), compression=compression)
    expect_error(lambda: one_step(optimizer, net), "weight_decay=0.0001, which torch's SGD adds "
                 "to the gradient before its momentum; the compressor applies the momentum "
                 "(momentum=0.9), so that decay would act outside it, 10x weaker")
    launched_nothing(compression)
    net = torch.nn.Linear(64, 64)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         named_parameters=net.named_parameters(),
                                         compression=hdgc.Compression.dgc(weight_decay=1e-4))
    one_step(optimizer, net)


def own_path_moves_momentum() -> None:
    net = torch.nn.Linear(64, 64)
    compression = hdgc.Compression.dgc()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.8, nesterov=True, weight_decay=1e-4)
    optimizer = hdgc.DistributedOptimizer(sgd, named_parameters=net.named_parameters(), compression=compression)
    assert compression.config.momentum == 0.8 and compression.config.nesterov
    assert compression.config.weight_decay == 1e-4
    assert all(g["momentum"] == 0 and g["weight_decay"] == 0 for g in optimizer.param_groups)
    one_step(optimizer, net)


def momentum_of_another_form_is_refused_or_warned_of() -> None:
    """Moving an SGD's momentum must not change its form silently: a dampening, which DGC's
    momentum lacks, is refused; blocksign's momentum is always Nesterov's, so a plain SGD's
    is moved with a warning, a Nesterov SGD's without."""
    def wrap(compression, **sgd):
        net = torch.nn.Linear(64, 64)
        return hdgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, **sgd),
                                         named_parameters=net.named_parameters(),
                                         compression=compression)

    expect_error(lambda: wrap(hdgc.Compression.dgc(), momentum=0.9, dampening=0.5), "dampening=0.5")
    for nesterov, warned in ((False, 1), (True, 0)):
        compression = hdgc.Compression.blocksign()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrap(compression, momentum=0.9, nesterov=nesterov)
        said = [w for w in caught if "Nesterov momentum, its only form" in str(w.message)]
        assert len(said) == warned, [str(w.message) for w in caught]
        assert compression.config.momentum == 0.9, compression.config


def weight_decay_per_param_group() -> None:
    """The usual "no decay on biases": each tensor keeps its group's decay, in the update
    itself. At density 1 (the bias all-reduced dense) the first step of DGC's momentum is
    ``-lr * mean_r(g_r + wd * w)`` per tensor, with the group's ``wd``: computed here from
    gradients all-reduced by Horovod. Catches a decay that reaches the settings but not the
    update (the config's 0 taken for every tensor), or the weight's decay given to the bias."""
    torch.manual_seed(100 + hvd.rank())  # each rank its own batch
    net = torch.nn.Linear(64, 64)  # weight: 4,096 entries, compressed
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    decays, lr = {"weight": 1e-2, "bias": 0.0}, 0.1
    compression = hdgc.Compression.dgc(density=1.0, small_density=None, value_dtype="float32")
    sgd = torch.optim.SGD([{"params": [net.weight], "weight_decay": decays["weight"]},
                           {"params": [net.bias], "weight_decay": decays["bias"]}], lr=lr, momentum=0.9)
    optimizer = hdgc.DistributedOptimizer(sgd, named_parameters=net.named_parameters(), compression=compression)
    assert compression.engine._weight_decays == decays
    assert all(g["momentum"] == 0 and g["weight_decay"] == 0 for g in optimizer.param_groups)
    named = dict(net.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    batch = torch.randn(4, 64)
    grads = torch.autograd.grad(net(batch).sum(), list(named.values()))
    averaged = {n: hvd.allreduce(g, op=hvd.Average, name=f"reference.{n}") for n, g in zip(named, grads)}
    optimizer.zero_grad()
    net(batch).sum().backward()
    optimizer.step()
    for name, p in net.named_parameters():
        expected = before[name] - lr * (averaged[name] + decays[name] * before[name])
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


def second_synchronize_sends_nothing() -> None:
    """A second synchronize() before step(), or step() after synchronize() without
    skip_synchronize() (Horovod's optimizer then synchronizes again, warning of the time
    only), on both paths: the averages must stay as they are, nothing is compressed again
    (the memories would take the average as a new gradient) and the step counts once."""
    for wrap, again in ((hdgc.DistributedOptimizer, "synchronize"), (hvd.DistributedOptimizer, "synchronize"),
                        (hvd.DistributedOptimizer, "step")):
        net = torch.nn.Linear(64, 64)
        prefix = f"again.{wrap.__module__}.{again}"
        compression = hdgc.Compression.topk(density=0.05)
        optimizer = wrap(torch.optim.SGD(net.parameters(), lr=0.1),
                         named_parameters=net.named_parameters(prefix), compression=compression)
        for step in range(2):  # the second step's backward starts afresh
            optimizer.zero_grad()
            net(torch.randn(4, 64, generator=torch.Generator().manual_seed(hvd.rank()))).sum().backward()
            optimizer.synchronize()
            averaged, sent_bytes = [p.grad.clone() for p in net.parameters()], compression.stats().bytes_sent
            weights = [p.detach().clone() for p in net.parameters()]
            if again == "synchronize":
                optimizer.synchronize()
                assert all(torch.equal(p.grad, a) for p, a in zip(net.parameters(), averaged)), \
                    f"{prefix}: compressed twice"
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # Horovod's: "This can cause training slowdown"
                    optimizer.step()
            assert all(torch.equal(p, w.add(a, alpha=-0.1)) for p, w, a in zip(net.parameters(), weights, averaged)), \
                f"{prefix}: the step applied something else than the first average"
            assert compression.stats().bytes_sent == sent_bytes > 0, f"{prefix}: {compression.stats()}"
            assert compression.stats().steps == step + 1, f"{prefix}: {compression.stats().steps} steps"


def unfrozen_after_construction() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    net[0].requires_grad_(False)
    optimizer = hdgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                          named_parameters=net.named_parameters(),
                                          compression=hdgc.Compression.topk(density=0.05))
    one_step(optimizer, net)
    net[0].requires_grad_(True)
    expect_error(lambda: one_step(optimizer, net), "['0.weight', '0.bias'] have gradients")
    net, head = torch.nn.Linear(64, 4), torch.nn.Linear(4, 4)
    optimizer = hdgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                          named_parameters=net.named_parameters(),
                                          compression=hdgc.Compression.topk(density=0.05))
    optimizer.add_param_group({"params": head.parameters()})
    expect_error(lambda: one_step(optimizer, torch.nn.Sequential(net, head)),
                 "['param_groups[1][0]', 'param_groups[1][1]'] have gradients")
    # An optimizer built again, as the error says, trains on: the old optimizer's hooks no
    # longer fire, and no collective of the refused step (launched during backward) is still
    # in flight; either would be a second collective under the bucket name the new one uses,
    # which Horovod refuses.
    optimizer = hdgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                          named_parameters=net.named_parameters(),
                                          compression=hdgc.Compression.topk(density=0.05))
    one_step(optimizer, net)


def momentum_cycled_by_a_scheduler() -> None:
    """OneCycleLR sets the SGD's momentum in param_groups at construction and every step: the
    fused optimizer, which moved it into the compressor before the scheduler existed, refuses
    it at the next step's first gradient, before launching anything (an exchange left in
    flight would collide with the next one's name), and the stock path at its first
    gradient."""
    for wrap in (hdgc.DistributedOptimizer, hvd.DistributedOptimizer):
        net = torch.nn.Linear(64, 64)
        compression = hdgc.Compression.dgc(named_parameters=net.named_parameters())
        # Ours moves an SGD's momentum into DGC; the stock path needs momentum=0 to start.
        momentum = 0.9 if wrap is hdgc.DistributedOptimizer else 0.0
        optimizer = wrap(torch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum),
                         named_parameters=net.named_parameters(), compression=compression)
        torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
        expect_error(lambda: one_step(optimizer, net), "cycle_momentum=False")
        if wrap is hdgc.DistributedOptimizer:
            assert all(p.grad is None or not optimizer.state[p] for p in net.parameters()), \
                "the SGD stepped with the scheduler's momentum before the refusal"
        else:
            launched_nothing(compression)


def scaled_training(wrap, prefix: str):
    """(model, topk compressor, ``wrap``ped SGD, CPU GradScaler); parameter names under
    ``prefix``, so that a refused step's collectives keep names of their own."""
    net = torch.nn.Linear(64, 64)
    compression = hdgc.Compression.topk(named_parameters=net.named_parameters(prefix), density=0.05)
    optimizer = wrap(torch.optim.SGD(net.parameters(), lr=0.1),
                     named_parameters=net.named_parameters(prefix), compression=compression)
    return net, compression, optimizer, torch.amp.GradScaler("cpu")


def grad_scaler_not_told() -> None:
    """A GradScaler in Horovod's recipe that the compressor was not given: its memories would
    keep scaled gradients, and every change of scale would multiply what they owe. Refused
    at the first synchronize() on both paths; attach_grad_scaler(None) (the scaler scales
    another loss) is taken."""
    for wrap in (hvd.DistributedOptimizer, hdgc.DistributedOptimizer):
        for told in (False, True):
            net, compression, optimizer, scaler = scaled_training(wrap, f"scaler.{wrap.__module__}.{told}")
            if told:
                compression.attach_grad_scaler(None)

            def scaled_step():
                optimizer.zero_grad()
                scaler.scale(net(torch.randn(4, 64)).sum()).backward()
                optimizer.synchronize()
                scaler.unscale_(optimizer)
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
                scaler.update()
            if told:
                scaled_step()
            else:
                expect_error(scaled_step, "compression.attach_grad_scaler(scaler)")


def grad_scaler_stepping_before_the_average() -> None:
    """PyTorch's recipe (scaler.step(optimizer) with no synchronize() before it) on Horovod's
    optimizer or ours: the scaler unscales and checks the local gradients, then step()
    averages them, and the update is the scaled average. Refused on both paths."""
    for wrap in (hvd.DistributedOptimizer, hdgc.DistributedOptimizer):
        net, compression, optimizer, scaler = scaled_training(wrap, f"early_scaler.{wrap.__module__}")
        compression.attach_grad_scaler(scaler)

        def pytorch_recipe():
            optimizer.zero_grad()
            scaler.scale(net(torch.randn(4, 64)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
        expect_error(pytorch_recipe, "optimizer.synchronize(); scaler.unscale_(optimizer)")


def adasum() -> None:
    """Horovod's Adasum optimizer compresses each parameter's change, not its gradient: the
    error says so (it said the tensor was no parameter's .grad)."""
    net = torch.nn.Linear(64, 64)
    compression = hdgc.Compression.topk(named_parameters=net.named_parameters("adasum"))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         named_parameters=net.named_parameters("adasum"),
                                         compression=compression, op=hvd.Adasum)
    expect_error(lambda: one_step(optimizer, net), "op=hvd.Adasum")


def hierarchical_on_one_host() -> None:
    expect_error(lambda: hdgc.Compression.dgc(hierarchical=True), "every worker runs on one host")


if __name__ == "__main__":
    hvd.init()
    double_momentum()
    weight_decay_left_outside_the_momentum()
    own_path_moves_momentum()
    momentum_of_another_form_is_refused_or_warned_of()
    weight_decay_per_param_group()
    second_synchronize_sends_nothing()
    unfrozen_after_construction()
    momentum_cycled_by_a_scheduler()
    grad_scaler_not_told()
    grad_scaler_stepping_before_the_average()
    hierarchical_on_one_host()
    adasum()
    print(f"rank {hvd.rank()} misuse ok", flush=True)
