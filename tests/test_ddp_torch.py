"""The DDP communication hook (``horovod_dgc.torch.ddp``) in real multi-process jobs:
``torchrun --standalone`` with Gloo on CPU, and the stock Horovod path under ``horovodrun``
for comparison (tests/workers/ddp_torch.py)."""
import importlib.util
import json
import os

import pytest
import torch

from conftest import ROOT, horovodrun, torchrun

PARITY_METHODS = ("dgc", "topk", "gaussiank", "scalecom", "blocksign", "dgc-sar")
# The hook needs no Horovod, and a GPU machine may have none; these two compare with Horovod
# or share a worker with its paths.
needs_horovod = pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                                   reason="Horovod is not installed")


# Two processes train, checkpoint and refuse below; the aggregation is checked on four.
@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_ddp_aggregated_gradient_equals_dense_reference(nproc):
    """Real parameters, and a complex one (its real and imaginary parts, as DDP's bucket holds
    them): each averaged gradient is the mean of the ranks' exact top-k."""
    out = torchrun("ddp_torch.py", nproc, ["aggregate,complex", "--methods", "topk,dgc"])
    for method in ("topk", "dgc"):
        assert out.count(f"{method} ddp aggregate ok") == nproc, out
        assert out.count(f"{method} ddp complex ok") == nproc, out


@needs_horovod
def test_ddp_hook_and_horovod_stock_path_give_the_same_parameters(tmp_path):
    """20 steps with the same seeds and per-rank gradients, a float32 and a bfloat16 model:
    the DDP hook (buckets rebuilt by DDP after the first step) and hvd.DistributedOptimizer
    end within 1e-6."""
    methods = ",".join(PARITY_METHODS)
    torchrun("ddp_torch.py", 2, ["train", "--methods", methods, "--out", str(tmp_path)])
    horovodrun("ddp_torch.py", 2, ["train", "--horovod", "--methods", methods,
                                   "--out", str(tmp_path)])
    first = torch.load(tmp_path / "ddp_rank0.pt")
    runs = [f"{method}/{dtype}" for method in PARITY_METHODS for dtype in ("float32", "bfloat16")]
    for rank in range(2):
        hooked = torch.load(tmp_path / f"ddp_rank{rank}.pt")
        stock = torch.load(tmp_path / f"horovod_rank{rank}.pt")
        for run in runs:
            difference = float((hooked[run].float() - stock[run].float()).abs().max())
            assert difference <= 1e-6, f"rank {rank} {run}: DDP and Horovod differ by {difference}"
            assert torch.equal(hooked[run], first[run]), f"{run}: ranks differ"


def test_ddp_gradient_accumulation_under_no_sync_equals_one_pass_of_the_sum():
    methods = ",".join(PARITY_METHODS)
    out = torchrun("ddp_torch.py", 2, ["accumulate", "--methods", methods])
    for method in PARITY_METHODS:
        assert out.count(f"{method} ddp accumulate ok") == 2, out


def test_ddp_on_process_groups_of_part_of_the_world():
    """Two DDP models on process groups of ranks 0-1 and 2-3: each group trains on its own
    ranks' gradients alone (no gradient mass lost), its ranks alike, the groups apart."""
    out = torchrun("ddp_torch.py", 4, ["subgroups", "--methods", ",".join(PARITY_METHODS)])
    for method in PARITY_METHODS:
        assert out.count(f"{method} ddp subgroups ok") == 4, out


@pytest.fixture(scope="module")
def unused_and_join():
    """One job for two: parameters no rank used, and uneven inputs under ``model.join()``."""
    return torchrun("ddp_torch.py", 2, ["unused,join", "--methods", ",".join(PARITY_METHODS)])


def test_ddp_parameters_no_rank_used_keep_their_memories(unused_and_join):
    """find_unused_parameters=True and static_graph=True: DDP applies nothing to a parameter
    no rank used in a step, so its memories must stay as they were (they lost what they sent)."""
    for method in PARITY_METHODS:
        for option in ("find_unused_parameters", "static_graph"):
            assert unused_and_join.count(f"{method} ['{option}'] ddp unused ok") == 2, unused_and_join


def test_ddp_uneven_inputs_under_join_lose_no_gradient_mass(unused_and_join):
    """A rank that ran out of inputs shadows the others' steps through the hook with zero
    gradients; the parameters DDP hands every rank at the end hold every rank's gradients of
    its own steps, less what the memories owe (with and without find_unused_parameters)."""
    for method in PARITY_METHODS:
        for options in ("[]", "['find_unused_parameters']"):
            assert unused_and_join.count(f"{method} {options} ddp join ok") == 2, unused_and_join


def test_ddp_adaptive_switch_loses_no_gradient_and_every_rank_decides_alike():
    """tests/workers/ddp_torch.py adaptive: every method forced dense for 10 steps and back
    (the parameters against the sum of the mean gradients minus what the memories owe), and
    decisions with the link given slow, fast and probed, identical on every rank."""
    out = torchrun("ddp_torch.py", 2, ["adaptive"])
    for kind in PARITY_METHODS:
        assert out.count(f"{kind} ddp forced switches ok") == 2, out
    assert out.count("ddp decisions agree") == 2, out


@pytest.mark.parametrize("nproc, older_torch", [
    pytest.param(1, False, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                    reason="NCCL needs a GPU per rank")),
    (2, False), (3, True)])
def test_ddp_transport_collectives_give_what_they_are_defined_to(nproc, older_torch):
    """Every collective of the hook's transport against the concatenation, average, root's
    message and exchanged chunks of the ranks' messages, on CPU tensors and, where a GPU is
    present, CUDA tensors (NCCL where each rank has a GPU of its own). ``older_torch``:
    without ``all_gather_single`` (new in torch 2.13; the hook's allgather failed with an
    AttributeError on older torch)."""
    out = torchrun("dist_transport_torch.py", nproc, ["--without-all-gather-single"] if older_torch else [])
    present = hasattr(torch.distributed, "all_gather_single") and not older_torch
    assert out.count("all_gather_single " + ("present" if present else "absent")) == nproc, out
    labels = ["gloo cpu"] + (["gloo cuda"] if torch.cuda.is_available() else []) + \
        (["nccl cuda"] if torch.cuda.device_count() >= nproc else [])
    for label in labels:
        assert out.count(f"{label} transport ok") == nproc, out


@pytest.mark.parametrize("nproc", [2, 3])
def test_horovod_transport_collectives_give_what_they_are_defined_to(nproc):
    """The same checks on the transport of both Horovod paths, an alltoall of uneven chunks
    (the sparse all-reduce's buckets) included."""
    out = horovodrun("dist_transport_torch.py", nproc, ["--horovod"])
    assert out.count("horovod cpu transport ok") == nproc, out


@pytest.fixture(scope="module")
def checkpoint_and_misuse():
    """One job for three: the hook's state round trip, what register() refuses, and a
    torch.compile'd DDP model."""
    return torchrun("ddp_torch.py", 2, ["checkpoint,misuse,compiled", "--methods", "dgc,scalecom"])


def test_ddp_state_checkpoint_round_trip(checkpoint_and_misuse):
    for method in ("dgc", "scalecom"):
        assert checkpoint_and_misuse.count(f"{method} checkpoint ok") == 2, checkpoint_and_misuse


def test_ddp_register_refuses_bad_input(checkpoint_and_misuse):
    assert checkpoint_and_misuse.count("misuse ok") == 2, checkpoint_and_misuse


def test_ddp_torch_compiled_model_trains_as_the_eager_one(checkpoint_and_misuse):
    assert checkpoint_and_misuse.count("dgc compiled ok") == 2, checkpoint_and_misuse


@needs_horovod
def test_ddp_grad_scaler_overflow_on_one_rank_skips_the_step_everywhere():
    """PyTorch's AMP recipe through the hook, float16 autocast: an overflow on rank 1 alone
    makes every rank skip and back off, memories and parameters untouched and identical."""
    out = torchrun("amp_torch.py", 2, ["--ddp"])
    for method in ("dgc", "dgc-sar", "topk", "scalecom", "blocksign"):
        assert out.count(f"{method} ddp amp ok") == 2, out


def test_the_fashion_mnist_example_trains_under_torchrun_where_horovod_cannot_be_imported(tmp_path):
    """The DDP guide's path (docs/guide/ddp.md) for a user without Horovod: ``examples/pytorch_fashion_mnist.py
    --path ddp`` under torchrun, every worker's import of Horovod made to fail (a
    sitecustomize on PYTHONPATH). Catches a Horovod import anywhere on that path (the example,
    ``Compression``, the hook), and a hook that does not apply the averaged gradient (the test
    accuracy would stay near chance, 0.1) or is bypassed (no bytes counted at density 0.001)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['horovod'] = None\n")
    torchrun(str(ROOT / "examples" / "pytorch_fashion_mnist.py"), 2,
             ["--path", "ddp", "--compression", "dgc", "--epochs", "2", "--train-images", "2048",
              "--json", str(tmp_path / "run.json")],
             PYTHONPATH=os.pathsep.join((str(tmp_path), str(ROOT))))
    last = json.loads((tmp_path / "run.json").read_text())["history"][-1]
    assert last["density"] == 0.001 and last["handed_ratio"] > 500, last
    assert last["accuracy"] > 0.4, last
