"""Real Horovod jobs (Gloo) through the stock DistributedGradientTape, eagerly and inside
tf.function: aggregation equals the dense reference (the N-worker simulation for the
two-stage methods), misuse is named, traffic is counted; horovod_dgc's own tape takes
Keras 3 variables."""

import pytest

from benchmarks.hierarchical_stress import TF_KIND_LISTS

from conftest import (TWO_HOSTS, check_dgc_hands_300x_fewer_bytes, check_one_worker_job, horovodrun,
                      traffic_figures)


def test_aggregated_gradient_equals_dense_reference_and_misuse_is_named():
    out = horovodrun("aggregate_tensorflow.py", 2, ["--function-methods", "topk,dgc"],
                     timeout_s=600)
    for method, mode in (("dgc", "eager"), ("topk", "function"), ("dgc", "function")):
        assert out.count(f"{method} {mode} aggregate ok") == 2, out
    assert out.count("misuse ok") == 2, out


@pytest.mark.parametrize("np", [1, 2])
def test_one_worker_where_horovod_skips_the_compressor_refuses_or_warns(np):
    check_one_worker_job("tensorflow", np)


@pytest.mark.slow  # the same allgather as topk's with another selection (unit-tested in graphs)
def test_a_tape_given_a_process_set_of_part_of_the_world_is_refused():
    out = horovodrun("process_set_tensorflow.py", 4)
    assert out.count("process set refused ok") == 4, out


def test_gaussiank_aggregated_gradient_equals_dense_reference():
    out = horovodrun("aggregate_tensorflow.py", 2,
                     ["--function-methods", "gaussiank", "--function-only"], timeout_s=600)
    assert out.count("gaussiank function aggregate ok") == 2, out


def test_dgc_hands_horovod_300x_fewer_bytes_than_dense():
    out = horovodrun("traffic_tensorflow.py", 2, timeout_s=600)
    check_dgc_hands_300x_fewer_bytes(traffic_figures(out), "tf.function")


# Horovod traces the exchange into a graph eagerly too: there one kind (blocksign: both
# stages' memories given as variables=) runs in make test, the others in make test-slow with
# blocksign's momentum variant and dgc-sar's exchange with other selections (2 minutes).
@pytest.mark.parametrize("kinds,modes,eager_kinds", [
    ("scalecom,blocksign,dgc-sar", "eager,function", "blocksign"),
    pytest.param("blocksign64,topk-sar,gaussiank-sar", "function", "", marks=pytest.mark.slow),
    pytest.param("scalecom,dgc-sar", "eager", "scalecom,dgc-sar", marks=pytest.mark.slow)])
def test_two_stage_methods_match_the_n_worker_simulation(kinds, modes, eager_kinds):
    out = horovodrun("twostage_tensorflow.py", 2, ["--kinds", kinds, "--modes", modes,
                                                    "--eager-kinds", eager_kinds], timeout_s=600)
    for kind in kinds.split(","):
        if "function" in modes:
            assert out.count(f"{kind} function twostage ok") == 2, out
        if kind in eager_kinds.split(","):
            assert out.count(f"{kind} eager twostage ok") == 2, out


@pytest.mark.slow  # 2.5 minutes; make test runs the same protocol on 3 and 4 PyTorch ranks
@pytest.mark.parametrize("np", [3, 4])
def test_sparse_allreduce_matches_the_n_worker_simulation(np):
    """The sparse all-reduce's regions and capacities depend on N: 3 and 4 workers too."""
    kinds = "dgc-sar,topk-sar"
    out = horovodrun("twostage_tensorflow.py", np, ["--kinds", kinds, "--modes", "function"],
                     timeout_s=600)
    for kind in kinds.split(","):
        assert out.count(f"{kind} function twostage ok") == np, out


@pytest.mark.parametrize("methods", [
    "dgc,scalecom,blocksign",  # one of each exchange: allgather, broadcast + allreduce, alltoall
    pytest.param("topk,gaussiank", marks=pytest.mark.slow)])  # the allgather again, 2 minutes
def test_keras_optimizer_compressors_need_no_variables(methods):
    out = horovodrun("keras_optimizer_tensorflow.py", 2, ["--methods", methods], timeout_s=600)
    for method in methods.split(","):
        assert out.count(f"{method} keras unnamed ok") == 2, out
    assert out.count("double momentum refused") == 2, out


def test_embedding_gradients_are_compressed_with_sparse_as_dense_and_named_without():
    out = horovodrun("sparse_tensorflow.py", 2, timeout_s=600)
    for path in ("tape", "keras"):
        for sparse_as_dense in (True, False):
            assert out.count(f"{path} sparse_as_dense={sparse_as_dense} sparse ok") == 2, out


@pytest.mark.slow  # 1.5 minutes a job, most of it tracing; its PyTorch twin runs in make test
@pytest.mark.parametrize("methods", [
    "dgc,scalecom,blocksign",  # one of each exchange: allgather, broadcast + allreduce, alltoall
    "topk,gaussiank"])
def test_keras_gradient_accumulation_compresses_once_a_step(methods):
    """backward_passes_per_step=2 through Horovod's Keras optimizer gives the weights of one
    pass of the two gradients' sum, and steps_per_execution=4 those of one step per run
    (tests/workers/accumulation_tensorflow.py)."""
    out = horovodrun("accumulation_tensorflow.py", 2, ["--methods", methods], timeout_s=600)
    for method in methods.split(","):
        assert out.count(f"{method} keras accumulation ok") == 2, out


@pytest.mark.slow  # 1.5 minutes a job, most of it tracing; its PyTorch twin runs in make test
@pytest.mark.parametrize("methods", [
    "dgc,scalecom,blocksign",  # one of each exchange: allgather, broadcast + allreduce, alltoall
    "topk,gaussiank"])
def test_loss_scale_overflow_on_one_rank_is_skipped_by_every_rank_and_memories_stay_unscaled(methods):
    out = horovodrun("amp_tensorflow.py", 2, ["--methods", methods], timeout_s=900)
    for method in methods.split(","):
        for policy in ("float32", "mixed_float16"):
            assert out.count(f"{method} {policy} tf amp ok") == 2, out


@pytest.mark.slow  # 1.5 minutes, most of it tracing; the PyTorch twin (AMP's scaler found unasked) runs in make test
def test_keras_fit_under_a_loss_scale_optimizer_keeps_memories_unscaled_unasked():
    """tests/workers/loss_scale_keras_tensorflow.py: tf_keras model.fit, no attach_loss_scale;
    the warm-up callback moves the density sent with fit's epochs."""
    out = horovodrun("loss_scale_keras_tensorflow.py", 2, timeout_s=600)
    assert out.count("keras fit loss scale ok") == 2, out


def test_bfloat16_models_twin_models_and_custom_loop_misuse():
    """tests/workers/conditions_tensorflow.py: a bfloat16 Keras 3 model on every method
    (dense tensors get the exact mean), two same-named models stepped in one tf.function, a
    LossScaleOptimizer nobody attached and DGC under Adam refused at the first step, an
    XLA-compiled step refused while traced."""
    out = horovodrun("conditions_tensorflow.py", 2, timeout_s=600)
    assert out.count("tensorflow conditions ok") == 2, out


def test_tensorflow_1_optimizers_other_reductions_and_graph_sessions():
    """tests/workers/legacy_tensorflow.py: Horovod's optimizer around a tf.compat.v1.train
    optimizer trains every method as the tape does; DGC and blocksign refuse its momentum and
    Adam; op=hvd.Sum and op=hvd.Adasum are refused; so is a TensorFlow 1 graph."""
    out = horovodrun("legacy_tensorflow.py", 2, timeout_s=600)
    for method in ("dgc", "topk", "gaussiank", "scalecom", "blocksign"):
        assert out.count(f"{method} legacy optimizer ok") == 2, out
    assert out.count("tensorflow 1 api ok") == 2, out


def test_own_tape_takes_keras_3_variables_and_matches_the_stock_tape():
    out = horovodrun("keras3_tape_tensorflow.py", 2, timeout_s=600)
    for method, mode in (("scalecom", "eager"), ("dgc", "function")):
        assert out.count(f"{method} {mode} keras3 tape ok") == 2, out


@pytest.mark.slow  # as its PyTorch twin; the redistribution itself is unit-tested in make test
def test_a_run_saved_on_2_workers_resumes_on_3_with_the_memories_redistributed(tmp_path):
    horovodrun("checkpoint_tensorflow.py", 2, ["--mode", "save", "--dir", str(tmp_path)], timeout_s=600)
    out = horovodrun("checkpoint_tensorflow.py", 3, ["--mode", "resume", "--dir", str(tmp_path)],
                     timeout_s=600)
    for method in ("dgc", "blocksign"):
        assert out.count(f"{method} resumed on 3 from 2 ok") == 3, out


@pytest.mark.parametrize("kinds", TF_KIND_LISTS)
def test_hierarchical_compresses_host_averages_between_hosts(kinds):
    """2 hosts x 2 workers in tf.function: each step's gradient and the memories equal a
    naive reference (topk) or the simulation of 2 workers fed the host averages."""
    out = horovodrun("hierarchy_tensorflow.py", 4, ["--kinds", kinds], timeout_s=600,
                     hosts=TWO_HOSTS)
    for kind in kinds.split(","):
        assert out.count(f"{kind} hierarchical ok") == 4, out


def test_forced_switches_lose_no_gradient_and_every_rank_decides_alike_with_the_tape_and_keras():
    """tests/workers/adaptive_tensorflow.py: every method through dense steps and back in a
    traced step (the parameters against the sum of the mean gradients minus what the
    memories owe), and the adaptive decisions with the link given by hand and probed,
    identical on every rank, through the tape and through model.fit with the callback."""
    out = horovodrun("adaptive_tensorflow.py", 2, timeout_s=600)
    for kind in ("topk", "gaussiank", "dgc", "dgc-sar", "scalecom", "blocksign"):
        assert out.count(f"{kind} tf forced switches ok") == 2, out
    assert out.count("tape decisions agree") == 2, out
    assert out.count("keras decisions agree") == 2, out
