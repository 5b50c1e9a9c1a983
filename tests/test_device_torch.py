"""Every method through the PyTorch engine on a GPU gives what it gives on the CPU.

The CPU path is checked against naive references elsewhere (test_core_references and the
device-parametrized core tests); here each method's whole round trip (compress, the emulated
collectives, decode, memories) runs on CUDA tensors and on CPU tensors from the same gradients,
over several steps, so that a device-dependent step (a CPU-only table, a tensor created on
the default device, a host-side loop that reads stale values) shows as a difference.
The CUDA tests are skipped without a CUDA device; on the CPU, the choices a GPU makes
(fixed-size selection) are checked against the CPU's own.
"""
import pytest
import torch

from benchmarks.host_syncs import HostReadCounter, compress_all, decode_all, gradients
from horovod_dgc.core.methods import BY_NAME, METHODS
from horovod_dgc.core.nonfinite import NonFiniteGradientError
from horovod_dgc.torch.engine import Engine

from conftest import WaitingOps

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# Sizes past the kernels' parallel threshold and the methods' min_numel, and a small tensor.
SHAPES = [(300, 4096), (64, 3, 7, 7), (1000,), (37,)]
WORLD = 3
STEPS = 4
# The sparse all-reduce's owners select among sums of values that travelled as float16, where
# equal magnitudes are common: float32 values keep the comparison free of ties.
CONFIGS = ([(spec.name, {}) for spec in METHODS]
           + [("dgc", {"aggregation": "sparse_allreduce", "value_dtype": "float32"}),
              ("topk", {"aggregation": "sparse_allreduce", "value_dtype": "float32"}),
              ("dgc", {"value_dtype": "int8"}), ("blocksign", {"momentum": 0.0})])
IDS = [name + "".join(f"-{v}" for v in options.values()) for name, options in CONFIGS]


def run(name, options, device, dtype, ops=None, memory_format=torch.contiguous_format, shapes=SHAPES):
    """Every rank's averaged gradients at each step, and rank 0's memories at the end
    (``ops``: the engines' TensorOps, if not their own; ``memory_format``: the 4-D
    gradients' layout)."""
    engines = [Engine(BY_NAME[name].build(**options), world_size=WORLD, rank=r) for r in range(WORLD)]
    for engine in engines:
        engine.ops = ops or engine.ops
    names = [f"t{i}" for i in range(len(shapes))]
    averages = []
    for step in range(STEPS):
        grads = [[g.to(memory_format=memory_format) if g.dim() == 4 else g for g in rank]
                 for rank in gradients(shapes, WORLD, step, device, dtype)]
        outputs = compress_all(engines, names, grads)
        decoded = decode_all(engines, names, shapes, outputs)
        averages.append([[a.float().cpu() for a in rank] for rank in decoded])
    memories = {key: tensor.float().cpu() for key, tensor in engines[0].state_dict()["states"]["t0"].items()}
    return averages, memories


def assert_same_run(expected_run, got_run, shapes=SHAPES):
    for step, (expected, got) in enumerate(zip(expected_run[0], got_run[0])):
        for rank, (e_rank, g_rank) in enumerate(zip(expected, got)):
            assert len(e_rank) == len(g_rank) == len(shapes)
            for shape, e, g in zip(shapes, e_rank, g_rank):
                assert g.shape == e.shape
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"step {step}, rank {rank}, {shape}: {m}")
    assert expected_run[1].keys() == got_run[1].keys()
    for key in expected_run[1]:
        torch.testing.assert_close(got_run[1][key], expected_run[1][key], rtol=1e-4, atol=1e-5)


@cuda_only
@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_every_method_gives_on_cuda_what_it_gives_on_the_cpu(name, options):
    assert_same_run(run(name, options, "cpu", torch.float32), run(name, options, "cuda", torch.float32))


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_choosing_as_on_a_gpu_changes_nothing_on_the_cpu(name, options):
    """The fixed-size selection a GPU takes (selection.select_by_blocks, no candidate bounds
    kept) sends what the CPU's selection sends, through the whole engine."""
    assert_same_run(run(name, options, "cpu", torch.float32),
                    run(name, options, "cpu", torch.float32, WaitingOps(defer_checks=True)))


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_channels_last_gradients_give_what_contiguous_ones_give(name, options):
    """A model in ``torch.channels_last`` (the usual layout for convolutions under autocast)
    has 4-D gradients whose storage order is not their element order: a flatten or a kernel
    that reads storage order would select, scale and keep other entries than it should.
    A compressed kernel's gradient and a small one's."""
    shapes = [(64, 3, 7, 7), (16, 3, 3, 3)]
    assert_same_run(run(name, options, "cpu", torch.float32, shapes=shapes),
                    run(name, options, "cpu", torch.float32, memory_format=torch.channels_last, shapes=shapes),
                    shapes)


@cuda_only
@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_bfloat16_gradients_send_on_cuda_as_much_as_on_the_cpu(name, options):
    """bfloat16 gradients hold many equal magnitudes, and CPU and GPU may pick different ones
    among equals at the threshold: the count of entries and the mass sent must agree, not
    the positions."""
    cpu, cuda = run(name, options, "cpu", torch.bfloat16), run(name, options, "cuda", torch.bfloat16)
    for step, (expected, got) in enumerate(zip(cpu[0], cuda[0])):
        for shape, e, g in zip(SHAPES, expected[0], got[0]):
            assert bool(torch.isfinite(g).all()), f"step {step}, {shape}"
            where = f"step {step}, {shape}"
            assert int(g.count_nonzero()) == pytest.approx(int(e.count_nonzero()), rel=0.05), where
            assert float(g.abs().sum()) == pytest.approx(float(e.abs().sum()), rel=0.02), where


# Host reads per rank per step with the GPU's choices (compress, decode), for the two tensors
# below: today's counts (benchmarks/host_syncs.py, whose count gave the H200's measured waits
# exactly). These methods read once per step, where the engine settles the step's checks and
# flags. A change that adds a read of GPU data fails here; one that removes reads lowers them.
MOST_HOST_READS = {"dgc": (0, 1), "topk": (0, 1), "scalecom": (0, 1), "blocksign": (0, 1)}


@pytest.mark.parametrize("name", sorted(MOST_HOST_READS))
def test_a_gpu_step_reads_back_no_more_than_today(name):
    shapes = [(300, 4096), (256, 64, 3, 3)]  # compressed by every method's defaults
    engines = [Engine(BY_NAME[name].build(), world_size=WORLD, rank=r) for r in range(WORLD)]
    names = [f"t{i}" for i in range(len(shapes))]
    most_compress, most_decode = MOST_HOST_READS[name]
    for step in range(3):
        grads = gradients(shapes, WORLD, step, "cpu")
        with HostReadCounter() as compress:
            outputs = compress_all(engines, names, grads)
        with HostReadCounter() as decode:
            decode_all(engines, names, shapes, outputs)
        assert compress.total <= most_compress * WORLD, (step, compress.sites)
        assert decode.total <= most_decode * WORLD, (step, decode.sites)


@pytest.mark.parametrize("method", ["dgc", "scalecom", "blocksign"])
@pytest.mark.parametrize("policy", ["skip", "raise"])
@pytest.mark.parametrize("nan_in", ["t1", "t2"], ids=["compressed", "dense"])
@pytest.mark.parametrize("as_on_a_gpu", [False, True], ids=["own-choice", "as-on-a-gpu"])
def test_a_step_with_a_nan_on_one_rank_is_dropped_by_every_rank(method, policy, nan_in, as_on_a_gpu):
    """Step 1 of 3 has a NaN in rank 1's gradient of a compressed tensor (t1) or of one that
    travels dense (t2, all-reduced). Every rank drops the step (each memory, the dense tensor's
    momentum included, stays as after step 0), passes NaN on for that tensor only (skip) or
    raises naming it at the step's end (raise); step 2 then runs as if step 1 had not happened,
    on both choices (the GPU's reads the flags once at the step's end). For ScaleCom, rank 1
    leads step 1: the NaN is in the leader's own selection."""
    shapes = [(300, 4096), (256, 64, 3, 3), (37,)]
    names = ["t0", "t1", "t2"]
    dense_small = {"small_density": None} if method == "dgc" else {}  # t2 travels dense
    engines = [Engine(BY_NAME[method].build(nonfinite=policy, **dense_small), world_size=WORLD, rank=r)
               for r in range(WORLD)]
    for engine in engines:
        engine.ops = WaitingOps(defer_checks=True) if as_on_a_gpu else engine.ops
    decode_all(engines, names, shapes, compress_all(engines, names, gradients(shapes, WORLD, 0, "cpu")))
    after_step0 = [{n: {k: v.clone() for k, v in s.items()} for n, s in e.state_dict()["states"].items()}
                   for e in engines]
    grads = gradients(shapes, WORLD, 1, "cpu")
    grads[1][names.index(nan_in)].view(-1)[5] = float("nan")
    outputs = compress_all(engines, names, grads)
    if policy == "raise":
        with pytest.raises(NonFiniteGradientError, match=f"'{nan_in}'"):
            decode_all(engines, names, shapes, outputs)
        # Ranks emulated in one process: the first to raise stops the others mid-step, which
        # in a real job would each raise at the same point. A job that goes on after it (an
        # elastic reset) drops the step that will not finish, as here.
        for engine in engines:
            engine.abandon_step()
    else:
        averages = decode_all(engines, names, shapes, outputs)
        for rank_averages in averages:
            for name, average in zip(names, rank_averages):
                if name != nan_in:
                    assert not torch.isnan(average).any(), name
                elif name == "t1":  # a compressed tensor some rank flagged is NaN throughout
                    assert torch.isnan(average).all()
                else:  # an all-reduce carries the NaN where it was, as a dense step would
                    assert torch.isnan(average.view(-1)[5])
    for engine, before in zip(engines, after_step0):
        states = engine.state_dict()["states"]
        assert states.keys() == before.keys() and "t2" in states
        for name, state in states.items():
            for key, value in state.items():
                assert torch.equal(value, before[name][key]), (engine.rank, name, key)
    outputs = compress_all(engines, names, gradients(shapes, WORLD, 2, "cpu"))
    averages = decode_all(engines, names, shapes, outputs)
    assert all(torch.isfinite(a).all() for rank_averages in averages for a in rank_averages)
