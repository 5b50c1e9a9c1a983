"""Bad settings fail at construction; bad messages name the rank and the tensor."""
import math

import pytest
import torch

from horovod_dgc.core import DGC, CompressCall, DGCConfig, MessageError, TopK, TopKConfig
from horovod_dgc.torch import Compression
from horovod_dgc.torch.ops import TorchOps

from conftest import OneRankTransport

ops = TorchOps()


@pytest.mark.parametrize("method", ["dgc", "topk", "gaussiank"])
@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan"), "0.1"])
def test_density_outside_zero_one_raises_value_error(method, density):
    with pytest.raises(ValueError, match="density"):
        getattr(Compression, method)(density=density)


@pytest.mark.parametrize("options,field", [(dict(momentum=-0.1), "momentum"), (dict(momentum=1.0), "momentum"),
                                           (dict(sample_ratio=0.0), "sample_ratio"),
                                           (dict(sample_ratio=1.5), "sample_ratio"),
                                           (dict(weight_decay=-1.0), "weight_decay"),
                                           (dict(clip_norm=0.0), "clip_norm"),
                                           (dict(retry_factor=1.0), "retry_factor"),
                                           (dict(value_dtype="int4"), "value_dtype"),
                                           (dict(nonfinite="ignore"), "nonfinite")])
def test_bad_dgc_settings_raise_value_error_at_construction(options, field):
    with pytest.raises(ValueError, match=field):
        Compression.dgc(**options)


@pytest.mark.parametrize("value_dtype", ["float16", "int8"])
def test_scalecom_refuses_values_its_all_reduce_would_sum_lossily(value_dtype):
    with pytest.raises(ValueError, match="value_dtype must be 'float32' for ScaleCom"):
        Compression.scalecom(value_dtype=value_dtype)


@pytest.mark.parametrize("small_density", [0.0, 1.5])
def test_small_density_outside_zero_one_raises_value_error(small_density):
    with pytest.raises(ValueError, match="small_density"):
        Compression.topk(small_density=small_density)


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError):
        Compression.topk(momentum=0.9)


def test_configs_are_frozen():
    config = TopKConfig()
    with pytest.raises(Exception):
        config.density = 0.5


def _messages(world_size: int, device: torch.device, name: str = "fc.weight"):
    method = DGC(DGCConfig(density=0.01))
    grad = torch.randn(4000, device="cpu").to(device)
    parts, layout = [], None
    for rank in range(world_size):
        state = method.init_state(ops, grad, True, world_size)
        result = method.compress(ops, state, grad, CompressCall(name, rank, world_size, 0, 0.01))
        parts.append(result.message)
        layout = result.layout
    return method, parts, layout


def _decode(parts, layout, world_size=3):
    return DGC().decompress(ops, torch.cat(parts), [layout], world_size, 0, ["float32"])[0]


def test_corrupt_header_names_sending_rank_and_tensor(device):
    _, parts, layout = _messages(3, device)
    parts[2] = parts[2].clone()
    parts[2][0] ^= 0xFF
    with pytest.raises(MessageError, match=r"rank 2 .*'fc.weight'.*magic"):
        _decode(parts, layout)


def test_message_for_another_tensor_is_refused(device):
    _, parts, layout = _messages(3, device)
    _, other, _ = _messages(3, device, name="fc.bias")
    with pytest.raises(MessageError, match=r"rank 1 .*'fc.weight'.*tensor id"):
        _decode([parts[0], other[1], parts[2]], layout)


def test_message_from_a_rank_claiming_another_rank_is_refused(device):
    _, parts, layout = _messages(3, device)
    with pytest.raises(MessageError, match=r"rank 1 .*sender rank is 0"):
        _decode([parts[0], parts[0], parts[2]], layout)


def test_truncated_message_is_refused_with_sizes(device):
    _, parts, layout = _messages(3, device)
    parts[2] = parts[2][:-8]
    with pytest.raises(MessageError, match=r"received \d+ bytes for tensor\(s\) .fc.weight., expected \d+"):
        _decode(parts, layout)


def test_rank_with_another_density_is_named(device):
    method, parts, layout = _messages(3, device)
    grad = torch.randn(4000, device="cpu").to(device)
    other = method.compress(ops, method.init_state(ops, grad, True, 3), grad,
                            CompressCall("fc.weight", 1, 3, 0, 0.02))
    with pytest.raises(MessageError, match=r"rank 1 .*'fc.weight'.*capacity is 80, expected 40"):
        _decode([parts[0], other.message, parts[2]], layout)


def test_rank_with_another_method_is_named_with_both_methods(device):
    _, parts, layout = _messages(3, device)
    grad = torch.randn(4000, device="cpu").to(device)
    topk = TopK(TopKConfig(density=0.01))
    other = topk.compress(ops, topk.init_state(ops, grad, True, 3), grad,
                          CompressCall("fc.weight", 1, 3, 0, 0.01))
    with pytest.raises(MessageError, match=r"rank 1 .*'fc.weight'.*method is 1 \(topk\), expected 2 \(dgc\)"):
        _decode([parts[0], other.message, parts[2]], layout)


def test_count_beyond_capacity_is_refused(device):
    """By the header check, which says so; a later check of the positions would refuse the
    message too, but only as "positions disagree with its count"."""
    _, parts, layout = _messages(3, device)
    parts[0] = parts[0].clone()
    header = parts[0][:48].view(torch.int32)
    header[6] = layout.capacity + 1
    with pytest.raises(MessageError, match=rf"rank 0 .*'fc.weight': count is {layout.capacity + 1}, "
                                           rf"expected 0 to {layout.capacity}$"):
        _decode(parts, layout)


@pytest.mark.parametrize("tensor", [torch.zeros(0, device="cpu"), torch.arange(10, device="cpu"),
                                    torch.ones(3, 3, dtype=torch.int32, device="cpu")])
def test_zero_element_and_integer_tensors_pass_through_untouched(tensor, device):
    tensor = tensor.to(device)
    compression = Compression.dgc()
    out, ctx = compression.compress(tensor)
    assert out is tensor and ctx is None


@pytest.mark.parametrize("method, options, field", [
    ("topk", dict(min_numel=0), "min_numel"), ("topk", dict(min_numel=True), "min_numel"),
    ("dgc", dict(warmup_epochs=-1), "warmup_epochs"), ("dgc", dict(aggregation="ring"), "aggregation"),
    ("gaussiank", dict(nonfinite="warn"), "nonfinite"),
])
def test_bad_shared_settings_raise_value_error_at_construction(method, options, field):
    """Settings every config inherits are checked at construction. Catches a dropped
    min_numel check, a bool taken for an integer, a negative warm-up accepted, and a dropped
    aggregation check."""
    with pytest.raises(ValueError, match=field):
        getattr(Compression, method)(**options)


@pytest.mark.parametrize("options", [dict(momentum=0.0), dict(density=1.0, small_density=1.0),
                                     dict(warmup_epochs=0), dict(min_numel=1)])
def test_settings_at_the_edges_of_their_ranges_are_accepted(options):
    """No momentum, a density of 1, no warm-up and min_numel 1 are valid. Catches bounds
    tightened by one (momentum in (0, 1), density in (0, 1), warmup_epochs >= 1)."""
    Compression.dgc(**options)


def test_untold_grad_scaler_is_found_on_the_thread_waiting_in_backward():
    """On a GPU the DDP hook runs on the autograd engine's thread while the training loop
    waits in backward() on its own: the check looks at the other threads' frames too (and
    only when asked: the Horovod paths check on the loop's thread)."""
    import threading
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)  # the waiting loop's local
    outcomes = {}

    def engine_thread(every_thread: bool) -> None:
        compression = Compression.topk()
        try:
            compression.check_grad_scaler_use(every_thread=every_thread)
            outcomes[every_thread] = "accepted"
        except ValueError as error:
            outcomes[every_thread] = str(error)

    for every_thread in (False, True):
        worker = threading.Thread(target=engine_thread, args=(every_thread,))
        worker.start()
        worker.join()
    assert outcomes[False] == "accepted"
    assert "GradScaler (scale 512.0)" in outcomes[True], outcomes[True]
    assert scaler.is_enabled()


def test_a_refused_momentum_says_how_to_keep_the_sgds_own():
    """Moving momentum to the compressor must not silently change it: the refusal names the
    SGD's value where the compressor's differs, and its Nesterov flag (which torch's SGD
    refuses without momentum, so the user would drop it)."""
    from horovod_dgc.torch.compression import check_plain_optimizer
    net = torch.nn.Linear(4, 4)
    dgc = Compression.dgc().config
    with pytest.raises(ValueError, match="and the compressor momentum=0.95, nesterov=True to keep yours"):
        check_plain_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.95, nesterov=True), dgc)
    with pytest.raises(ValueError, match=r"applies it\), or use"):
        check_plain_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), dgc)


def test_a_compressor_used_before_hvd_init_or_ddp_register_says_which_to_call(monkeypatch):
    """A DDP user who calls set_epoch (or attach_grad_scaler) before ``ddp.register`` reaches
    the default transport, Horovod's: the error names both ways out, not Horovod's bare "use
    hvd.init()". (Without Horovod installed: tests/workers/ddp_torch.py's misuse mode.)"""
    import horovod.torch as hvd
    monkeypatch.setattr(hvd, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match=r"hvd.init\(\) before .*ddp.register\(model, compression\)"):
        Compression.topk().set_epoch(0)


def test_a_complex_parameter_is_refused_at_construction_naming_it():
    """Horovod all-reduces no complex tensor: the fused optimizer refuses one when it is built,
    not at the first step (where Horovod's own error names neither parameter nor way out)."""
    from horovod_dgc.torch import DistributedOptimizer
    real = torch.nn.Parameter(torch.zeros(3))
    phase = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    sgd = torch.optim.SGD([real, phase], lr=0.1)
    with pytest.raises(ValueError, match=r"\['phase'\] are complex: .*torch.view_as_real"):
        DistributedOptimizer(sgd, named_parameters=[("real", real), ("phase", phase)],
                             compression=Compression.topk())


def test_a_frozen_complex_parameter_is_accepted_and_the_rest_trains():
    """A complex parameter that takes no gradient is never all-reduced: the refusal above is
    for trainable ones only. The real parameter beside it still takes top-k's step: its k
    largest gradient entries (all equal here, so exactly k of them) move by the learning rate
    (a 2-D tensor above ``min_numel``, so at the method's density, not ``small_density``)."""
    from horovod_dgc.torch import DistributedOptimizer
    real = torch.nn.Parameter(torch.zeros(100, 100))
    phase = torch.nn.Parameter(torch.ones(3, dtype=torch.complex64), requires_grad=False)
    compression = Compression.topk()
    compression.use_transport(OneRankTransport())
    sgd = torch.optim.SGD([real, phase], lr=0.1)
    optimizer = DistributedOptimizer(sgd, named_parameters=[("real", real), ("phase", phase)],
                                     compression=compression)
    (real.sum() * phase.abs().sum()).backward()
    optimizer.step()
    k = math.ceil(compression.config.density * real.numel())
    assert sorted(real.detach().unique().tolist()) == pytest.approx([-0.3, 0.0])
    assert int(real.detach().ne(0).sum()) == k
    assert torch.equal(phase.detach(), torch.ones(3, dtype=torch.complex64))


def _maximizing_run(method: str, maximize: bool) -> torch.Tensor:
    """5 steps of our DistributedOptimizer over SGD(momentum=0.9, maximize=maximize), on a
    loss negated where ``maximize`` is False: the same objective both ways."""
    from horovod_dgc.torch import DistributedOptimizer
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 50))
    compression = getattr(Compression, method)()
    compression.use_transport(OneRankTransport())
    optimizer = DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=method == "blocksign",
                        maximize=maximize), named_parameters=net.named_parameters(), compression=compression)
    inputs = torch.Generator().manual_seed(1)
    for _ in range(5):
        optimizer.zero_grad()
        loss = net(torch.randn(8, 64, generator=inputs)).square().mean()
        (loss if maximize else -loss).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


@pytest.mark.parametrize("method", ["dgc", "blocksign"])
def test_a_maximizing_sgd_whose_momentum_moved_to_the_compressor_ascends_as_the_negated_loss(method):
    """Momentum is linear in the gradient: moved into the compressor, an SGD with
    maximize=True takes exactly the steps that a descent of the negated loss takes."""
    assert torch.equal(_maximizing_run(method, True), _maximizing_run(method, False))


def test_a_maximizing_sgd_is_refused_where_the_compressor_applies_weight_decay():
    """SGD(maximize=True) negates what it is given: a weight decay the compressor already added
    would grow the parameters (torch's SGD decays after negating). Refused when our optimizer
    would move the SGD's decay into dgc, and on every path where dgc has a decay of its own."""
    from horovod_dgc.torch import DistributedOptimizer
    from horovod_dgc.torch.compression import check_plain_optimizer
    weights = torch.nn.Parameter(torch.ones(100, 100))
    compression = Compression.dgc()
    compression.use_transport(OneRankTransport())
    with pytest.raises(ValueError, match=r"maximize=True.*weight_decay=0.1.*negated objective"):
        DistributedOptimizer(torch.optim.SGD([weights], lr=0.1, weight_decay=0.1, maximize=True),
                             named_parameters=[("weights", weights)], compression=compression)
    with pytest.raises(ValueError, match=r"maximize=True.*weight_decay=0.01"):
        check_plain_optimizer(torch.optim.SGD([weights], lr=0.1, maximize=True),
                              Compression.dgc(weight_decay=0.01).config)


def test_one_compressor_for_two_models_is_refused_and_an_optimizer_built_anew_is_not():
    """A compressor's memories are keyed by parameter name: given to a second model's optimizer
    (a GAN's discriminator beside its generator, both named "0.weight", "0.bias"), it would mix
    their memories, and a second model with names of its own would still share its step. An
    optimizer built anew over the same model (after unfreezing a layer) keeps the compressor."""
    from horovod_dgc.torch import DistributedOptimizer
    generator, discriminator = torch.nn.Sequential(torch.nn.Linear(4, 3)), torch.nn.Sequential(torch.nn.Linear(4, 3))
    compression = Compression.topk()
    compression.use_transport(OneRankTransport())
    generator[0].bias.requires_grad_(False)
    DistributedOptimizer(torch.optim.SGD(generator.parameters(), lr=0.1),
                         named_parameters=generator.named_parameters(), compression=compression)
    generator[0].bias.requires_grad_(True)
    DistributedOptimizer(torch.optim.SGD(generator.parameters(), lr=0.1),
                         named_parameters=generator.named_parameters(), compression=compression)
    with pytest.raises(ValueError, match=r"another model's parameters.*\['0.weight', '0.bias'\]"
                                         r".*each optimizer \(or DDP model\) its own"):
        DistributedOptimizer(torch.optim.SGD(discriminator.parameters(), lr=0.1),
                             named_parameters=discriminator.named_parameters(), compression=compression)
    with pytest.raises(ValueError, match=r"another model's parameters already: .*each optimizer \(or DDP model\) its own"):
        compression.bind(discriminator.named_parameters(prefix="discriminator"))
