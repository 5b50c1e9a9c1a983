"""The stock path's buckets (horovod_dgc.torch.queue): when a bucket launches, with which
tensors, and which average each tensor gets back, against a hand-made exchange."""
import pytest
import torch

from horovod_dgc.core.collectives import backward_buckets
from horovod_dgc.torch.queue import StockQueue


class Exchanges:
    """Records launches; an exchange's averages are its gradients times 10."""

    def __init__(self):
        self.launched = []
        self.finished = []

    def launch(self, label, entries):
        self.launched.append((label, [name for name, _, _ in entries]))
        return label, entries

    def finish(self, exchange):
        label, entries = exchange
        self.finished.append(label)
        return [grad * 10 for _, grad, _ in entries]


def queue_of(names, sizes, cap):
    exchanges = Exchanges()
    # ``names`` in the order buckets take them (backward_buckets reverses the model's order).
    buckets = backward_buckets(names[::-1], sizes[::-1], cap)
    return StockQueue(buckets, exchanges.launch, exchanges.finish), exchanges


def test_a_bucket_launches_when_its_last_tensor_arrives_whatever_the_order():
    queue, exchanges = queue_of(["c", "b", "a", "z"], [4, 4, 4, 4], cap=8)
    grads = {n: torch.full((2,), float(i)) for i, n in enumerate("abcz")}
    ctxs = {"b": queue.add("b", grads["b"], None)}
    assert exchanges.launched == []
    ctxs["c"] = queue.add("c", grads["c"], None)
    assert exchanges.launched == [("bucket.c", ["c", "b"])]  # membership order, not arrival
    ctxs["z"] = queue.add("z", grads["z"], None)
    ctxs["a"] = queue.add("a", grads["a"], None)
    assert exchanges.launched[1] == ("bucket.a", ["a", "z"])
    for name in "zabc":
        assert torch.equal(queue.result(ctxs[name]), grads[name] * 10)
    assert exchanges.finished == ["bucket.a", "bucket.c"]  # each bucket finished once


def test_the_first_result_launches_every_bucket_left_open_in_bucket_order():
    """A frozen parameter never arrives: its bucket goes with the tensors it has."""
    queue, exchanges = queue_of(["a", "b", "c", "d"], [4, 4, 4, 4], cap=8)
    ctx_d = queue.add("d", torch.ones(1), None)
    ctx_a = queue.add("a", torch.ones(1), None)
    assert exchanges.launched == []
    assert torch.equal(queue.result(ctx_d), torch.full((1,), 10.0))
    assert exchanges.launched == [("bucket.a", ["a"]), ("bucket.c", ["d"])]
    assert torch.equal(queue.result(ctx_a), torch.full((1,), 10.0))


def test_a_tensor_larger_than_the_cap_is_a_bucket_alone_and_names_outside_are_not_taken():
    queue, exchanges = queue_of(["big", "a", "b"], [100, 4, 4], cap=8)
    queue.add("big", torch.ones(1), None)
    assert exchanges.launched == [("bucket.big", ["big"])]
    assert queue.takes("a") and not queue.takes("elsewhere")


def test_a_tensor_handed_over_twice_before_its_bucket_went_is_refused():
    queue, _ = queue_of(["a", "b"], [4, 4], cap=8)
    queue.add("a", torch.ones(1), None)
    with pytest.raises(RuntimeError, match="'a' was handed to compress\\(\\) twice"):
        queue.add("a", torch.ones(1), None)


def test_forget_drops_a_step_interrupted_before_its_buckets_went():
    queue, exchanges = queue_of(["a", "b"], [4, 4], cap=8)
    queue.add("a", torch.ones(1), None)
    queue.forget()
    queue.add("a", torch.ones(1), None)  # a new step: not a second hand-over
    ctx = queue.add("b", torch.ones(1), None)
    assert exchanges.launched == [("bucket.a", ["a", "b"])]
    assert torch.equal(queue.result(ctx), torch.full((1,), 10.0))
