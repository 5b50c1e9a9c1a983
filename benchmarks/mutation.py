"""Whether the tests catch plausible bugs (``make mutation-check``).

Each mutant of :data:`MUTANTS` is one small edit that someone could write by mistake (a
missing ``min(1, .)``, a sum where a mean belongs, a memory kept on a skipped step). It is
applied to a copy of the working tree, the tests of its layer run there (``-m "not slow"``,
stopping at the first failure), and the table says which test failed, or that none did: a
mutant that survives is a bug the tests would let through. The working tree itself is never
edited. A mutant of a C kernel (``torch/kernels/*.c``) is compiled into the copy
(``setup.py build_ext --inplace``) before its tests run, and the copy's built kernels are put
back afterwards.

    .venv/bin/python -m benchmarks.mutation [--only ID,...] [--layer core|torch|tensorflow]
                                            [--out results/mutation]

A mutant of compression between hosts runs the one job that tests that mode (a 4-worker job
late in its layer's test files), which the table names.

A mutant that no test catches takes its layer's whole test set (core about 1.5 minutes, torch
about 7, tensorflow about 6 on 2 cores); a caught one usually seconds. Exit status 1 when a
mutant survives or its edit no longer applies (the code moved: update the catalogue).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

from benchmarks import ROOT, worker_env

LAYERS = ("core", "torch", "tensorflow")
# Each layer's tests, fastest and most direct first (the run stops at the first failure).
TESTS: Dict[str, Tuple[str, ...]] = {
    "core": ("test_adaptive.py", "test_core_bucket.py", "test_core_references.py", "test_core_methods.py", "test_core_selection.py",
             "test_core_twostage.py", "test_core_sparse_allreduce.py", "test_core_warmup.py",
             "test_core_hosts.py", "test_traffic_model.py", "test_bad_input.py", "test_kernels_torch.py",
             "test_device_torch.py", "test_triton_memory.py", "test_triton_bits.py", "test_triton_messages.py", "test_triton_selection.py",
             "test_triton_signs.py",
             "test_checkpoint_torch.py",
             "test_codecs.py"),
    "torch": ("test_adaptive.py", "test_core_bucket.py", "test_core_methods.py", "test_bad_input.py", "test_device_torch.py",
              "test_checkpoint_torch.py", "test_torch_multiprocess.py", "test_ddp_torch.py",
              "test_elastic_torch.py"),
    "tensorflow": ("test_tensorflow_bucket.py", "test_tensorflow_parity.py", "test_tensorflow_bad_input.py",
                   "test_tensorflow_shared_exchange.py", "test_tensorflow_variables.py",
                   "test_tensorflow_multiprocess.py"),
}
TIMEOUT_S = 1800
KERNELS = "horovod_dgc/torch/kernels/"
KERNEL_TESTS = ("test_kernels_torch.py", "test_codecs.py")


@dataclass(frozen=True)
class Mutant:
    """One plausible bug: ``old`` (found exactly once in ``path``) replaced by ``new``."""

    id: str
    path: str
    old: str
    new: str
    bug: str
    # The one test that judges it, where its layer's files would reach it only after minutes:
    # compression between hosts, which one 4-worker job of each framework tests.
    test: Optional[str] = None

    @property
    def compiled(self) -> bool:
        """Whether the edit is to a C kernel, which the copy must build again to take it."""
        return self.path.startswith(KERNELS) and self.path.endswith((".c", ".h"))

    @property
    def layer(self) -> str:
        """Whose tests run: the adapter's for an adapter file, else the core's (an adapter's
        ``ops.py`` and its kernels are the core's ``TensorOps``, which the core's tests run
        on)."""
        for layer in ("torch", "tensorflow"):
            if (self.path.startswith(f"horovod_dgc/{layer}/") and not self.path.endswith("/ops.py")
                    and not self.path.startswith(KERNELS)):
                return layer
        return "core"

    @property
    def tests(self) -> Tuple[str, ...]:
        """Its layer's test files, the kernels' own first for a C kernel; or its one test."""
        if self.test:
            return (self.test,)
        if self.compiled:
            return KERNEL_TESTS + tuple(t for t in TESTS["core"] if t not in KERNEL_TESTS)
        return TESTS[self.layer]


def _m(id: str, path: str, old: str, new: str, bug: str, test: Optional[str] = None) -> Mutant:
    return Mutant(id, f"horovod_dgc/{path}", old, new, bug, test)


TORCH_HOSTS_TEST = "test_torch_multiprocess.py::test_hierarchical_compresses_host_averages_between_hosts"
TF_HOSTS_TEST = "test_tensorflow_multiprocess.py::test_hierarchical_compresses_host_averages_between_hosts"


MUTANTS: Tuple[Mutant, ...] = (
    # DGC
    _m("dgc-clip-bound-over-n", "core/dgc.py", "bound = cfg.clip_norm / call.world_size ** 0.5",
       "bound = cfg.clip_norm / call.world_size", "local clipping to C / N instead of C / sqrt(N)"),
    _m("dgc-clip-without-min", "core/dgc.py",
       "return grad, ops.minimum(bound / ops.maximum(norm, 1e-30), 1.0) * factor",
       "return grad, bound / ops.maximum(norm, 1e-30) * factor",
       "clipping scales short gradients up to the bound"),
    _m("dgc-weight-decay-scaled", "core/dgc.py",
       "grad, factor = ops.add(grad, call.param, factor, weight_decay), 1.0",
       "grad, factor = ops.add(grad, call.param, 1.0, weight_decay), 1.0",
       "weight decay added to the gradient still under the loss scale"),
    _m("dgc-small-masked", "core/dgc.py", "return self._small_memory if call.small else self.memory",
       "return self.memory", "small tensors' momentum masked like large ones'"),
    _m("momentum-unmasked", "core/memory.py",
       'momentum = ops.scatter_zero(state["momentum"], indices) if self.masked else state["momentum"]',
       'momentum = state["momentum"]', "no momentum factor masking"),
    _m("velocity-zeroed", "core/memory.py",
       'return {"momentum": momentum, "velocity": ops.scatter_sub(state["velocity"], indices, sent)}',
       'return {"momentum": momentum, "velocity": ops.scatter_zero(state["velocity"], indices)}',
       "the velocity sent is zeroed, losing the wire's rounding"),
    _m("nesterov-dense-scaled", "core/memory.py", "update = ops.add(momentum, grad, 1.0, grad_scale)",
       "update = ops.add(momentum, grad, 1.0, 1.0)",
       "a dense Nesterov update adds the gradient still under the loss scale"),
    # error feedback
    _m("residual-zeroed", "core/memory.py",
       'return {"residual": ops.scatter_sub(state["residual"], indices, sent)}',
       'return {"residual": ops.scatter_zero(state["residual"], indices)}',
       "the residual sent is zeroed, losing the wire's rounding"),
    _m("residual-dense-scaled", "core/memory.py", "return ops.scale(ops.copy(grad), grad_scale), state",
       "return ops.copy(grad), state", "dense tensors keep the loss scale"),
    _m("sent-before-rounding", "core/sparse.py",
       "sent = ops.cast(ops.slice(decoded, 0, count), ops.dtype(x))\n            next_bound = 0.0",
       "sent = selected\n            next_bound = 0.0",
       "the memory forgets what the wire format rounds or clamps"),
    _m("skipped-step-kept", "core/sparse.py", "return state, layout.empty(ops, header, like=grad), 0, 0.0",
       "return accumulated.state, layout.empty(ops, header, like=grad), 0, 0.0",
       "a non-finite step's memory is kept"),
    _m("sum-not-mean", "core/sparse.py", "sums, 1.0 / world_size)", "sums, 1.0)",
       "the decoded messages summed, not averaged"),
    _m("flag-never-set", "core/nonfinite.py", "return ops.where(finite, 0, FLAG_NONFINITE)", "return 0",
       "a non-finite gradient is never flagged to the other ranks"),
    # selection
    _m("topk-count-floor", "core/selection.py",
       "return min(numel, max(1, math.ceil(round(density * numel, 6))))",
       "return min(numel, max(1, int(round(density * numel, 6))))", "k rounded down"),
    _m("topk-one-short", "core/selection.py",
       "chosen = ops.nonzero(ops.greater_equal(magnitudes, ops.kth_largest(magnitudes, k)))",
       "chosen = ops.nonzero(ops.greater_equal(magnitudes, ops.kth_largest(magnitudes, k + 1)))",
       "the candidates' cut at the (k+1)-th largest"),
    _m("ties-unsorted", "core/selection.py",
       "return ops.sort(ops.gather(positions, ops.topk_abs(ranked_keys(ops, x, positions), k)))[0]",
       "return ops.gather(positions, ops.topk_abs(ranked_keys(ops, x, positions), k))",
       "positions out of order after a tie"),
    _m("ties-highest-first", "core/selection.py",
       "ops.add(magnitude_bits(ops, x), positions, _POSITION_SPAN, -1)",
       "ops.add(magnitude_bits(ops, x), positions, _POSITION_SPAN, 1)",
       "ties at the k-th largest go to the highest positions (another top-k than the bucket's)"),
    # buckets
    _m("bucket-partial-block-padding", "core/bucket.py",
       "real_block += [1 if j * block < segment.numel else 0 for j in range(blocks)]",
       "real_block += [1 if (j + 1) * block <= segment.numel else 0 for j in range(blocks)]",
       "a segment's last, partial block taken for padding (a boundary off by one)"),
    _m("bucket-ranked-across-segments", "core/bucket.py",
       "return ops.add(base, ops.where(real, ops.add(magnitude_bits(ops, x), 1), 0), 1, -1)",
       "return ops.add(base, ops.where(real, ops.add(magnitude_bits(ops, x), 1), 0), 0, -1)",
       "entries ranked across the whole bucket: one threshold for every segment"),
    _m("bucket-one-k", "core/bucket.py",
       "ks = tuple(top_count(d, s.numel) for d, s in zip(densities, bucket.segments))",
       "ks = (top_count(densities[0], bucket.segments[0].numel),) * len(bucket.segments)",
       "the first tensor's k used for every tensor of the bucket"),
    _m("bucket-candidates-shortfall-unchecked", "core/bucket.py",
       "    if not bool(ops.all_within(counts, tables.ks, ops.numel(positions))):\n        return FromCandidates(",
       "    if False:\n        return FromCandidates(",
       "a bucket selects from its candidates though a segment holds fewer than its k of them"),
    _m("bucket-candidates-small-predicted", "core/bucket.py",
       "    return segment.numel < EXACT_BELOW_NUMEL", "    return False",
       "a bucket's small tensors collect candidates at a predicted bound, which their k-th largest "
       "outruns often enough that the bucket seldom selects from its candidates"),
    _m("kernel-block-bound-of-first-block", "torch/kernels/streaming.c",
       "candidates->bound_bits = candidates->block_bounds[k];",
       "candidates->bound_bits = candidates->block_bounds[0];",
       "the memory pass compares every block of a range with its first block's bound"),
    _m("bucket-small-masked", "core/bucket.py", "            if not segment.small:\n",
       "            if segment.small:\n", "DGC's momentum masked in a bucket's small tensors, not its large"),
    _m("bucket-gaussian-moments-across-segments", "core/bucket.py",
       "block_segment=ints([s for s, seg in zip(slots, segments) for _ in range(seg.span // ALIGN)])",
       "block_segment=ints([0 for s, seg in zip(slots, segments) for _ in range(seg.span // ALIGN)])",
       "Gaussian-k's mean and deviation taken over the whole bucket, not each segment"),
    _m("bucket-gaussian-first-threshold", "core/bucket.py",
       "ops.repeat_each(t, tables.reach, reach.total)",
       "ops.repeat_blocks(t, reach.total, reach.total)",
       "every segment's entries counted at the first segment's threshold"),
    _m("bucket-gaussian-capacity-plus-one", "core/bucket.py",
       "int(j < c)", "int(j <= c)",
       "a segment over its capacity sends one entry more than capacity"),
    _m("bucket-gaussian-no-lowest", "core/bucket.py",
       "ops.where(ops.greater_equal(reached, tables.lowest_count), t, lowest)", "t",
       "Gaussian-k's last threshold kept when it lets fewer than 2k/3 entries through"),
    _m("scalecom-bucket-loss-scale-kept", "core/scalecom.py",
       "accumulated = self.memory.accumulate(ops, state, grad, call.unscale, spare=call.spare, block=plan.block)",
       "accumulated = self.memory.accumulate(ops, state, grad, 1.0, spare=call.spare, block=plan.block)",
       "a ScaleCom bucket's memory takes its gradients in the loss scale's units"),
    _m("bucket-memories-left-behind", "torch/engine.py",
       "            self._split_buckets_holding(bucket.names)\n", "",
       "a rebuilt bucket (DDP's after its first step) starts from zero memories"),
    _m("no-fallback-bound", "core/selection.py",
       "    threshold = ops.cond(count < k, lambda: candidates.lower_bound(k), lambda: threshold)\n", "",
       "fewer than k entries sent when the retries end short"),
    _m("gaussian-one-sided", "core/selection.py", "return NormalDist().inv_cdf(1.0 - density / 2.0)",
       "return NormalDist().inv_cdf(1.0 - density)", "Gaussian-k's quantile of one tail"),
    _m("gaussian-no-mean", "core/selection.py", "return ops.abs(mean) + ops.sqrt(variance) * gaussian_z(density)",
       "return ops.sqrt(variance) * gaussian_z(density)", "Gaussian-k's threshold without the mean"),
    _m("gaussian-adjust-swapped", "core/selection.py",
       "t = t * ops.where(count < low, GAUSSIAN_LOWER_BY, GAUSSIAN_RAISE_BY)",
       "t = t * ops.where(count < low, GAUSSIAN_RAISE_BY, GAUSSIAN_LOWER_BY)",
       "Gaussian-k raises the threshold when too few entries reach it"),
    # ScaleCom
    _m("scalecom-fixed-leader", "core/scalecom.py", "return call.step % call.world_size", "return 0",
       "rank 0 always leads"),
    _m("scalecom-memory-unrounded", "core/scalecom.py",
       "state = self.memory.update(ops, state, indices, ops.cast(decoded, state_dtype(handover.dtype)))",
       'state = self.memory.update(ops, state, indices, ops.gather(handover.data["p"], indices))',
       "a float64 model's memory forgets the float32 rounding of the values sent"),
    _m("low-pass-sent-unfiltered", "core/memory.py", "sent = ops.scale(ops.copy(sent), self.beta)",
       "sent = ops.copy(sent)", "the low-pass memory subtracts the whole value sent"),
    _m("low-pass-gradient-unfiltered", "core/memory.py",
       'grad_scale * self.beta, out=reuse(spare, "memory"))', 'grad_scale, out=reuse(spare, "memory"))',
       "the low-pass memory adds the whole gradient"),
    # blocksign
    _m("blocksign-short-block-mean", "core/blocksign.py",
       "parts.append(ops.scale(ops.slice(sums, full, 1), 1.0 / rest))",
       "parts.append(ops.scale(ops.slice(sums, full, 1), 1.0 / block))",
       "the last, short block's scale divided by the full block length"),
    _m("blocksign-server-sum", "core/blocksign.py",
       'return ops.scale_add(ops.scale(total, 1.0 / world_size), 1.0, state["server"])',
       'return ops.scale_add(total, 1.0, state["server"])', "the server sums instead of averaging"),
    _m("blocksign-server-no-feedback", "core/blocksign.py",
       'return ops.scale_add(ops.scale(total, 1.0 / world_size), 1.0, state["server"])',
       "return ops.scale(total, 1.0 / world_size)", "no error feedback on the server"),
    _m("blocksign-plain-momentum", "core/blocksign.py",
       'return ops.add(grad, momentum, unscale, mu), 1.0, {**state, "momentum": momentum}',
       'return momentum, 1.0, {**state, "momentum": momentum}', "plain momentum instead of Nesterov's"),
    _m("blocksign-bucket-scale-across-segments", "core/blocksign.py",
       "send_scales[j] += [worker_base + b + (0 if",
       "send_scales[j] += [b + (0 if",
       "every tensor of a bucket sent with its first tensor's worker scales"),
    _m("blocksign-bucket-segment-end-off-by-one", "core/blocksign.py",
       "gather_bytes += range(at, at + sent)", "gather_bytes += range(at + 1, at + sent + 1)",
       "a tensor's signs read one byte late from its owners' messages (a boundary off by one)"),
    _m("blocksign-bucket-server-count-of-the-tensor", "core/blocksign.py",
       "server_counts += shards.block_counts(valid, shards.owner_block_count(shard))",
       "server_counts += shards.block_counts(n, shards.owner_block_count(shard))",
       "a bucket's server scales divided by the tensor's entries, not those of the rank's shard"),
    _m("blocksign-bucket-tail-kept", "core/blocksign.py",
       "    return x if tail is None else ops.scatter_zero(x, tail)",
       "    return x",
       "the padding in a tensor's last byte of a bucket keeps the sign its decode gave it"),
    _m("blocksign-bucket-scales-of-the-first-sender", "core/blocksign.py",
       "else wire.part_at(layout, r, 1) // 4 + b", "else wire.part_at(layout, 0, 1) // 4 + b",
       "an owner decodes every sender's signs with the first sender's scales"),
    _m("message-set-zero-words-forgotten", "core/wire.py",
       "bases, at = [], zero + ZERO_WORDS * 4", "bases, at = [], zero",
       "a message set's parts read 8 bytes early (the zero words after the headers forgotten)"),
    _m("message-set-padding-from-a-source", "core/wire.py",
       "table += [zero] * (layout.part_bytes(i) - len(entries) * width)",
       "table += [base] * (layout.part_bytes(i) - len(entries) * width)",
       "a part's padding bytes copied from its source instead of zeros"),
    _m("message-part-at-the-first-part", "core/wire.py",
       "return message * layout.nbytes + layout.part_spans[part][0]",
       "return message * layout.nbytes + HEADER_BYTES",
       "every part of a received message read where its first part begins"),
    _m("received-headers-contiguous", "core/wire.py",
       "ops.rows(data, 0, layouts.pop().nbytes, HEADER_BYTES, len(expected))",
       "ops.rows(data, 0, HEADER_BYTES, HEADER_BYTES, len(expected))",
       "the headers of a received set read end to end instead of one per message"),
    _m("constant-tensor-in-one-place", "torch/ops.py",
       "            if len(at) == 1:\n                out[at[0]] = value",
       "            if True:\n                out[at[0]] = value",
       "a tensor word (a sender's non-finite flag) written in the first header of a set only"),
    _m("sign-of-zero-negative", "torch/ops.py", "bits = (x >= 0).view(torch.uint8).view(torch.int64)",
       "bits = (x > 0).view(torch.uint8).view(torch.int64)", "sign(0) = -1"),
    # sparse all-reduce, warm-up, traffic
    _m("sparse-allreduce-sum", "core/sparse_allreduce.py",
       "ops.scatter_add(ops.copy(state[\"owner_residual\"]), where, ops.scale(values, 1.0 / world))",
       "ops.scatter_add(ops.copy(state[\"owner_residual\"]), where, values)", "the owners sum instead of averaging"),
    _m("warmup-root-of-w", "core/warmup.py", "return self.final_density ** (1.0 / (self.warmup_epochs + 1))",
       "return self.final_density ** (1.0 / max(1, self.warmup_epochs))", "warm-up factor rho^(1/W)"),
    _m("warmup-epoch-offset", "core/warmup.py", "return max(self.ratio ** (e + 1), self.final_density)",
       "return max(self.ratio ** e, self.final_density)", "epoch 0 runs dense"),
    _m("warmup-epoch-rounded-up", "core/warmup.py", "e = max(math.floor(epoch), 0)",
       "e = max(math.ceil(epoch), 0)",
       "a started epoch counts as finished"),
    _m("allgather-bytes-n", "core/collectives.py", "return (n - 1) * nbytes", "return n * nbytes",
       "an allgather counted as N messages per worker"),
    _m("allreduce-bytes-half", "core/collectives.py", "return 2 * (n - 1) / n * nbytes",
       "return (n - 1) / n * nbytes", "a ring all-reduce counted as one pass"),
    _m("torch-allreduce-summed", "torch/collectives.py",
       "handle = hvd.allreduce_async(message, op=hvd.Average,", "handle = hvd.allreduce_async(message, op=hvd.Sum,",
       "the all-reduce of a method's messages (ScaleCom's values) sums instead of averaging"),
    _m("wait-spins", "torch/collectives.py", "        _sleep_until_done(handle)\n", "",
       "a wait for a collective spins in Horovod's own wait, taking a core from the workers that "
       "share it",
       "test_torch_multiprocess.py::test_a_rank_waiting_for_a_late_peer_sleeps_instead_of_spinning"),
    _m("tf-allreduce-summed", "tensorflow/collectives.py", "return hvd.allreduce(message, op=hvd.Average,",
       "return hvd.allreduce(message, op=hvd.Sum,",
       "TensorFlow: the all-reduce of a method's messages sums instead of averaging"),
    _m("ddp-allreduce-not-averaged", "torch/dist_collectives.py", "handle.result.div_(handle.average_over)",
       "handle.result.div_(1)", "the DDP hook's all-reduce of messages left as a sum over the workers"),
    _m("fraction-zero-accepted", "core/validation.py", "not 0.0 < value <= 1.0 or math.isnan(value)",
       "not 0.0 <= value <= 1.0 or math.isnan(value)",
       "a density (or other fraction) of 0 accepted at construction"),
    _m("momentum-one-accepted", "core/validation.py", "not 0.0 <= value < 1.0:",
       "not 0.0 <= value <= 1.0:", "a momentum of 1, which never forgets, accepted at construction"),
    _m("raw-position-past-the-end", "core/codecs.py",
       "return ops.all_within(positions, 0, self.numel - 1)",
       "return ops.all_within(positions, 0, self.numel)",
       "a raw position one past the tensor's end accepted"),
    _m("bitmap-count-unchecked", "core/codecs.py", "return positions, ops.equal(n_set, count)",
       "return positions, ops.equal(count, count)",
       "a bitmap with more or fewer set bits than its header's count accepted"),
    _m("index-coding-largest", "core/codecs.py",
       "return min(candidates, key=lambda c: (part_bytes(c.parts), c.code))",
       "return max(candidates, key=lambda c: (part_bytes(c.parts), c.code))",
       "the largest index coding chosen instead of the smallest"),
    _m("header-count-unchecked", "core/wire.py",
       "high = self.header(rank, step, self.capacity, FLAG_NONFINITE, traced_id)",
       "high = self.header(rank, step, self.capacity + 1, FLAG_NONFINITE, traced_id)",
       "a count past the message's capacity accepted"),
    _m("stats-steps-short", "core/stats.py", "steps=max(t.steps, step - self._first_step + 1)",
       "steps=max(t.steps, step - self._first_step)", "statistics count one step too few"),
    _m("stats-ratio-handed", "core/stats.py", "return self.dense_network_bytes / self.network_bytes",
       "return self.dense_bytes / self.network_bytes", "the network ratio mixes handed and network bytes"),
    _m("sparse-allreduce-owner-forgets", "core/sparse_allreduce.py",
       'return message, {**state, "owner_residual": owner}', "return message, state",
       "what an owner does not forward is lost"),
    _m("elias-fano-low-bits", "core/codecs.py",
       "return max(0, (self.numel // max(self.capacity, 1)).bit_length() - 1)",
       "return max(0, (self.numel // max(self.capacity, 1)).bit_length())",
       "Elias-Fano keeps one low bit more than its definition"),
    # checkpoints and hosts
    _m("resume-sums-memories", "core/state.py",
       "return ops.cast(ops.scale(total, 1.0 / len(tensors)), ops.dtype(tensors[0]))",
       "return ops.cast(total, ops.dtype(tensors[0]))", "resuming on another world sums the ranks' memories"),
    _m("resume-first-shard", "core/state.py",
       "value = ops.slice(ops.pad(value, world_size * length), rank * length, length)",
       "value = ops.slice(ops.pad(value, world_size * length), 0, length)",
       "every rank resumes the first shard of a sharded memory"),
    _m("resume-rank-0-part", "core/state.py", "        return parts[rank]\n", "        return parts[0]\n",
       "every rank resumes rank 0's part in the same world"),
    _m("host-leader-fixed", "core/hosts.py", "return self.leader_ranks[self.index]",
       "return self.leader_ranks[0]",
       "every host takes the first host's leader"),
    # value coding, non-finite gradients, warm-up and traffic (2026-12-02)
    _m("int8-scale-128", "core/codecs.py",
       "scale = ops.scale(ops.block_abs_max(padded, self.capacity), 1.0 / INT8_LEVELS)",
       "scale = ops.scale(ops.block_abs_max(padded, self.capacity), 1.0 / 128)",
       "int8's scale the largest magnitude / 128: the largest value clamped to 127 levels"),
    _m("float16-unclamped", "core/codecs.py", "values = ops.clamp(values, FORMAT_MAX[self.dtype])",
       "values = values", "values beyond float16's range travel as Inf"),
    _m("skipped-step-finite-average", "core/nonfinite.py",
       "return ops.cond(finite, lambda: x, lambda: nan_like(ops, ops.numel(x), dtype, x))",
       "return x", "a step some rank could not send hands a finite average (no scaler sees it)"),
    _m("raise-policy-ignored", "core/nonfinite.py", 'if policy != "raise":', "if True:",
       'nonfinite="raise" never raises'),
    _m("dgc-group-decay-ignored", "core/dgc.py",
       "weight_decay = cfg.weight_decay if call.weight_decay is None else call.weight_decay",
       "weight_decay = cfg.weight_decay", "per-tensor weight decays (parameter groups) ignored"),
    _m("blocksign-worker-no-feedback", "core/blocksign.py",
       'return ops.concat(messages), {**state, "residual": residual}, handover',
       "return ops.concat(messages), state, handover", "no error feedback on the worker"),
    _m("blocksign-block-scales-of-shard-0", "core/blocksign.py",
       "ops.slice(scales, 0 if self.config.block_size is None else j * per_shard, per_shard)",
       "ops.slice(scales, 0, per_shard)", "every shard carries the first shard's block scales"),
    _m("scalecom-nonfinite-untold", "core/scalecom.py",
       'values = nan_unless(ops, handover.data["finite"], values, dtype)', "values = values",
       "a rank's non-finite gradient off the leader's indices is not told to the others"),
    _m("warmup-steps-per-epoch-ignored", "core/warmup.py", "return step / self.steps_per_epoch",
       "return epoch", "steps_per_epoch= does not advance the warm-up"),
    _m("warmup-stall-unwarned", "core/warmup.py",
       "elif step >= WARMUP_STALL_STEPS and not self._advanced:", "elif False:",
       "a warm-up whose epoch never advances is not warned of"),
    _m("alltoall-bytes-whole", "core/collectives.py",
       "if kind in (ALLTOALL, BROADCAST):\n        return (n - 1) / n * nbytes",
       "if kind in (ALLTOALL, BROADCAST):\n        return nbytes",
       "an alltoall or broadcast counted with the worker's own share"),
    _m("resume-other-config", "core/state.py", 'if state["config"] != config:', "if False:",
       "a state saved with another config (density, momentum) is loaded"),
    _m("resume-other-rank", "core/state.py",
       'if (state["world_size"], state["rank"]) != (world_size, rank):', "if False:",
       "another rank's or another world's state is loaded as this rank's"),
    _m("resume-other-length", "core/state.py", "if ops.numel(value) != want:", "if False:",
       "a memory of another length is loaded"),
    # the PyTorch adapter
    _m("torch-skipped-step-kept", "torch/engine.py", "keep = finite and name not in self._unapplied",
       "keep = name not in self._unapplied", "memories kept when some rank was not finite"),
    _m("torch-dense-unscaled", "torch/engine.py",
       "        if scale != 1.0:\n            update = update * scale\n", "",
       "dense results not put back under the loss scale"),
    _m("torch-sparse-unscaled", "torch/engine.py",
       "return update if loss_scale == 1.0 else update.mul_(loss_scale)", "return update",
       "sparse results not put back under the loss scale"),
    _m("torch-spare-is-the-memory", "torch/engine.py", "self._spares[name] = kept if keep else staged",
       "self._spares[name] = staged if keep else kept", "the memory kept is handed out as scratch"),
    _m("torch-small-density", "torch/engine.py", "density = self.config.density_for(step, self.epoch, small)",
       "density = self.config.density_for(step, self.epoch)", "small tensors lose their density floor"),
    _m("fused-second-synchronize", "torch/optimizer.py",
       "        if self._synchronized:\n            return\n", "",
       "synchronize() twice compresses the average again"),
    _m("fused-one-weight-decay", "torch/optimizer.py", "if len(set(decays.values())) > 1:", "if False:",
       "per-group weight decays replaced by the first group's"),
    _m("fused-dense-averages-not-written", "torch/optimizer.py",
       "torch._foreach_copy_([p.grad for p in sent], self._compression.finish_dense(exchange))",
       "self._compression.finish_dense(exchange)",
       "the fused path's dense tensors averaged but each rank's own gradient applied"),
    _m("ddp-unused-memories-updated", "torch/ddp.py", "engine.leave_unapplied(unused)",
       "engine.leave_unapplied([])", "the DDP hook updates the memories of parameters no rank used"),
    _m("fused-momentum-left-in-sgd", "torch/optimizer.py", "group.update(momentum=0.0, nesterov=False)",
       "group.update(nesterov=False)", "the fused path's SGD keeps the momentum it moved to DGC"),
    _m("fused-decay-left-in-sgd", "torch/optimizer.py", '            group["weight_decay"] = 0.0\n',
       '            group["weight_decay"] = group["weight_decay"]\n',
       "the fused path's SGD keeps the weight decay it moved to DGC"),
    _m("fused-nesterov-dropped", "torch/optimizer.py", 'moved["nesterov"] = bool(chosen["nesterov"])',
       'moved["nesterov"] = False', "the fused path drops the SGD's Nesterov flag"),
    _m("dense-bucket-compressed-memories", "core/method.py", "layout = self.state_layout(bucket.compressed)",
       "layout = self.state_layout(True)",
       "tensors sent dense as a bucket keep the memories of compressed ones"),
    _m("torch-adam-accepted", "torch/compression.py",
       "    if not isinstance(optimizer, torch.optim.SGD):\n        raise ValueError(",
       "    if False:\n        raise ValueError(", "DGC accepts Adam, whose moments apply momentum twice"),
    _m("torch-sgd-momentum-accepted", "torch/compression.py", "if mine and any(theirs):", "if False:",
       "DGC accepts an SGD with momentum"),
    _m("zero-judged-by-wrapper", "torch/compression.py", "return optimizer.optim", "return optimizer",
       "a ZeroRedundancyOptimizer judged by itself, not by the SGD it builds"),
    _m("ddp-dense-to-first-views", "torch/ddp.py",
       "torch._foreach_copy_([flight.views[position] for position in positions],",
       "torch._foreach_copy_(flight.views[:len(positions)],",
       "a DDP bucket's dense averages written over its first views, compressed ones among them"),
    _m("stock-average-compressed-again", "torch/compression.py",
       "if synchronizing and name in self._exchanged:\n                return True",
       "if False:\n                return True",
       "step() after synchronize() on Horovod's optimizer compresses the average again"),
    _m("bucket-buffer-cleared-at-launch", "torch/engine.py",
       'else self._flat_buffer(bucket, grads, "gradients")[0]',
       'else self._flat_buffer(bucket, grads, "gradients")[0].zero_()',
       "a bucket's buffer cleared when it launches, where gradients accumulated into the last "
       "step's averages (the .grad views) still lie"),
    _m("bucket-averages-viewed-each-step", "torch/engine.py",
       "own[0].data_ptr() == flat.data_ptr() or destination is own[0]):", "own[0].data_ptr() == flat.data_ptr()):",
       "a two-stage bucket's averages handed out as new views of a new flat tensor every step "
       "(two operations per tensor, where the cached views of the gradients' buffer cost none)"),
    _m("bucket-padding-left-as-averaged", "torch/engine.py",
       "                own[0].copy_(flat)\n            self._zero_padding(bucket, own[0])",
       "                own[0].copy_(flat)",
       "the average of a dropped step left in the gradients' buffer with NaN in its padding, so "
       "every later step of the bucket is flagged non-finite"),
    _m("world-change-unnoticed", "torch/compression.py",
       "if (transport.size(), transport.rank()) != (engine.world_size, engine.rank):", "if False:",
       "a compressor exchanges in a resized world with the old world's memories"),
    _m("world-checked-after-horovod-is-handed-a-tensor", "torch/compression.py",
       "        self._check_place_in_the_world()\n        if Engine.passes_through(tensor):",
       "        if Engine.passes_through(tensor):",
       "in a world resized under Horovod's own elastic state, a survivor hands Horovod its step's "
       "first placeholder before it refuses; when its peer has refused and shut Horovod down first, "
       "that call fails as a recoverable reset and the elastic driver waits for hosts",
       "test_elastic_torch.py::test_a_reset_that_bypasses_our_state_is_refused_naming_the_old_and_new_world"),
    _m("two-optimizers-one-compressor", "torch/compression.py", "if len(holders) > 1:", "if False:",
       "one compressor given to two optimizers is not refused"),
    _m("broadcast-state-step-counted", "torch/optimizer.py",
       "return any(frame.f_code is hvd.broadcast_optimizer_state.__code__ for frame in caller_frames())",
       "return False", "Horovod's broadcast_optimizer_state counts as a training step"),
    _m("unfrozen-parameter-unrefused", "torch/optimizer.py",
       "if p.grad is not None and p not in self._delay]", "if False]",
       "a parameter unfrozen after the fused optimizer was built is applied unaveraged"),
    _m("complex-parameter-accepted", "torch/optimizer.py", "    if complex_named:", "    if False:",
       "a complex parameter is taken by the fused optimizer and fails at its first step in Horovod's "
       "all-reduce, which names neither the parameter nor a way out",
       "test_bad_input.py::test_a_complex_parameter_is_refused_at_construction_naming_it"),
    _m("maximize-with-decay-accepted", "torch/compression.py",
       'if weight_decay and any(g.get("maximize", False) for g in groups):', "if False:",
       "an SGD with maximize=True negates a weight decay the compressor added: the parameters grow",
       "test_bad_input.py::test_a_maximizing_sgd_is_refused_where_the_compressor_applies_weight_decay"),
    _m("compressor-shared-by-two-models", "torch/compression.py",
       "if renamed or not any(id(p) in bound for p in params.values()):", "if False:",
       "one compressor given to two models mixes their memories under the same parameter names",
       "test_bad_input.py::test_one_compressor_for_two_models_is_refused_and_an_optimizer_built_anew_is_not"),
    _m("frozen-complex-parameter-refused", "torch/optimizer.py",
       "if p.is_complex() and p.requires_grad]", "if p.is_complex()]",
       "a model with a frozen complex parameter, which is never all-reduced, cannot build the fused "
       "optimizer",
       "test_bad_input.py::test_a_frozen_complex_parameter_is_accepted_and_the_rest_trains"),
    _m("ddp-complex-gradient-half-averaged", "torch/ddp.py", "    if not param.is_complex():\n        return view",
       "    if True:\n        return view",
       "the DDP hook takes bucket.gradients()'s view of a complex gradient, which covers half of it: "
       "the other half stays each rank's own",
       "test_ddp_torch.py::test_ddp_aggregated_gradient_equals_dense_reference"),
    _m("complex-memories-counted-as-complex", "torch/compression.py",
       "p.numel() * (2 if p.is_complex() else 1)", "p.numel()",
       "a checkpoint of the DDP hook with a complex parameter is refused when loaded: its memories "
       "hold the real view's entries, twice the parameter's count",
       "test_ddp_torch.py::test_ddp_aggregated_gradient_equals_dense_reference"),
    _m("ddp-scheduler-momentum-unchecked", "torch/ddp.py",
       "check_plain_optimizer(self._optimizer, self.compression.config, _INSTEAD)", "pass",
       "the DDP hook misses a momentum a scheduler set in the SGD after registration"),
    # the TensorFlow adapter
    _m("tf-skipped-step-kept", "tensorflow/engine.py", "assign(tf.where(finite, new[key], old[key]))",
       "assign(new[key])", "memories kept when some rank was not finite"),
    _m("tf-sparse-unscaled", "tensorflow/engine.py", "flat = flat * tf.cast(message.loss_scale, flat.dtype)",
       "flat = tf.identity(flat)", "sparse results not put back under the loss scale"),
    _m("tf-dense-unscaled", "tensorflow/engine.py",
       "update = tf.cast(update, reducible) * tf.cast(scale, reducible)",
       "update = tf.cast(update, reducible)",
       "dense results not put back under the loss scale"),
    _m("tf-two-stage-unscaled", "tensorflow/twostage.py", "update = update * tf.cast(scale, update.dtype)",
       "update = tf.identity(update)", "two-stage results not put back under the loss scale"),
    _m("tf-two-stage-skipped-step-kept", "tensorflow/twostage.py",
       "with tf.control_dependencies([self._keep_if(finite, name, state, new_state)]):",
       "with tf.control_dependencies([self._keep_if(tf.constant(True), name, state, new_state)]):",
       "two-stage memories kept when some rank was not finite"),
    _m("tf-warmup-epoch-offset", "tensorflow/engine.py",
       "epoch = tf.minimum(step // schedule.steps_per_epoch, schedule.warmup_epochs)",
       "epoch = tf.minimum(step // schedule.steps_per_epoch + 1, schedule.warmup_epochs)",
       "a schedule driven by steps_per_epoch runs one epoch ahead in a graph"),
    _m("tf-adam-accepted", "tensorflow/compression.py", "        if not sgd:\n            raise ValueError(",
       "        if False:\n            raise ValueError(", "DGC accepts a Keras Adam"),
    _m("tf-sgd-momentum-accepted", "tensorflow/compression.py", "if mine and theirs:", "if False:",
       "DGC accepts a Keras SGD with momentum"),
    _m("tf-set-epoch-ignored", "tensorflow/engine.py",
       "self._density_index.assign(self.densities.index(self.density))", "self._density_index.assign(0)",
       "set_epoch() does not reach the traced step's density"),
    _m("keras-callback-epoch-unset", "tensorflow/callbacks.py", "self.compressor.set_epoch(epoch)", "pass",
       "the Keras warm-up callback does not advance the epoch"),
    _m("keras-callback-optimizer-unchecked", "tensorflow/callbacks.py",
       "check_optimizer(self.model.optimizer)", "pass",
       "the Keras warm-up callback does not check the optimizer at fit's start"),
    _m("tf-elastic-accepted", "tensorflow/compression.py", 'if int(os.environ.get("HOROVOD_ELASTIC", "0")):',
       "if False:", "an elastic TensorFlow job is not refused (its traced step keeps the old world)"),
    _m("tf-resume-steps-lost", "tensorflow/engine.py", "self._steps[name].assign(step)", "pass",
       "a resumed TensorFlow compressor starts its step counters again"),
    _m("tf-dense-nonfinite-kept", "tensorflow/engine.py",
       "self._keep_if(finite, sent.name, sent.old_state, sent.new_state)",
       "self._keep_if(tf.constant(True), sent.name, sent.old_state, sent.new_state)",
       "a dense tensor's momentum kept on a step some rank could not send"),
    _m("tf-bucket-nonfinite-kept", "tensorflow/engine.py",
       "return [self._keep_if(finite, name, sent.old_states[name], sent.new_states[name])",
       "return [self._keep_if(tf.constant(True), name, sent.old_states[name], sent.new_states[name])",
       "a bucket's memories kept on a step some rank could not send"),
    _m("tf-bucket-one-density", "tensorflow/engine.py",
       "densities=tuple(tuple(d) for d in zip(", "densities=tuple((d[0],) * len(d) for d in zip(",
       "one tensor's density (its k's share) used for every tensor of a TensorFlow bucket"),
    _m("tf-bucket-unscaled", "tensorflow/engine.py", "flat = flat * tf.cast(sent.loss_scale, flat.dtype)",
       "flat = tf.identity(flat)", "a bucket's results not put back under the loss scale"),
    _m("tf-two-stage-bucket-nonfinite-kept", "tensorflow/twostage.py",
       "kept = [self._keep_if(finite, name, begun.old_states[name], state)",
       "kept = [self._keep_if(tf.constant(True), name, begun.old_states[name], state)",
       "a two-stage bucket's memories kept on a step some rank could not send"),
    _m("tf-two-stage-bucket-unscaled", "tensorflow/twostage.py",
       "update = update * tf.cast(begun.loss_scale, update.dtype)", "update = tf.identity(update)",
       "a two-stage bucket's results not put back under the loss scale"),
    _m("tf-alltoall-chunks-dropped", "tensorflow/collectives.py", "if chunks is not None:", "if False:",
       "an alltoall whose destinations take chunks of different sizes cut into equal ones"),
    # The adaptive switch: a bucket's dense step (flush), the cost model and rule, the decisions
    _m("flush-shards-kept", "core/method.py", "        if layout.sharded:\n            shards = self.state_buckets",
       "        if False:\n            shards = self.state_buckets",
       "a flushed bucket leaves its sharded memory (server or owner residual) out of the average"),
    _m("flush-residual-kept", "core/memory.py",
       'return ops.add(state["residual"], grad, 1.0, grad_scale), emptied(ops, state, "residual")',
       'return ops.add(state["residual"], grad, 1.0, grad_scale), state',
       "a flush sends the residual and keeps it too (sent twice)"),
    _m("flush-velocity-forgotten", "core/memory.py", 'return (ops.add(update, state["velocity"]),',
       "return (update,", "DGC's flush sends the momentum step without the velocity, then empties it"),
    _m("flush-momentum-reset", "core/memory.py", 'emptied(ops, {**state, **dense_state}, "velocity"))',
       'emptied(ops, emptied(ops, {**state, **dense_state}, "velocity"), "momentum"))',
       "a flush restarts DGC's momentum from zero"),
    _m("flush-rounding-sign", "core/method.py", "ops.add(total, arrived, 1.0, -1.0 / loss_scale)",
       "ops.add(arrived, total, 1.0 / loss_scale, -1.0)",
       "what the wire's float16 rounds away kept with the wrong sign"),
    _m("flush-unscaled", "core/method.py",
       "sent = ops.cast(total if unscaled else ops.scale(ops.copy(total), loss_scale), wire_dtype)",
       "sent = ops.cast(total, wire_dtype)", "a dense step's average goes back without the loss scale"),
    _m("adaptive-no-margin", "core/adaptive.py",
       "if current == COMPRESSED and dense_s < (1.0 - margin) * compressed_s:",
       "if current == COMPRESSED and dense_s < compressed_s:",
       "a bucket goes dense on any predicted gain, flapping on noise"),
    _m("adaptive-link-message-bytes", "core/adaptive.py", "sent = network_bytes(ALLREDUCE, large_bytes, world_size)",
       "sent = large_bytes", "the link's time per byte read from the probe's size, not the ring's 2(N-1)/N"),
    _m("adaptive-samples-dense", "core/adaptive.py", "            if self.mode(label) == COMPRESSED:",
       "            if True:", "a dense bucket's flush time taken as its compute cost"),
    _m("adaptive-watch-one-sided", "core/adaptive.py", "return not level / factor < exchange_s < level * factor",
       "return exchange_s >= level * factor", "a link that frees up never brings a decision forward"),
    _m("adaptive-local-decisions", "core/adaptive.py",
       'agreed = self.collectives.mean(self.switch.local_compute_s(labels), "adaptive.measurements")',
       "agreed = self.switch.local_compute_s(labels)",
       "each rank decides on its own measurements, not the ranks' average"),
    _m("adaptive-skipped-decision", "core/adaptive.py",
       "due = any(settings.decides_at(s) for s in unseen)",
       "due = settings.decides_at(step)",
       "a decision step that falls between two step ends (Keras' steps_per_execution) never decides"),
    _m("adaptive-restore-forgets-steps", "core/adaptive.py", "        self._last_step = steps_taken - 1\n",
       "        self._last_step = -1\n",
       "a restored switch takes at once a decision due before its checkpoint, overriding the restored modes"),
    _m("adaptive-probe-never-full", "core/adaptive.py",
       "if largest_bytes > first and link.time_s(ALLREDUCE, largest_bytes, world) < FULL_PROBE_BELOW_S:",
       "if False:", "the link read from a 4 MiB probe alone, which one host's caches make look fast"),
    _m("adaptive-dense-mode-ignored", "torch/compression.py", "        if self._adaptive.dense(label):",
       "        if False:", "a bucket reported dense still exchanged compressed"),
    _m("adaptive-stale-labels-decided", "torch/adaptive.py", "        if self._noted_this_step:\n",
       "        if False:\n", "buckets DDP numbered before it rebuilt them decided on and reported forever"),
    _m("ddp-step-never-ended", "torch/ddp.py", "            self.compression.end_step()\n", "",
       "the DDP hook never ends the compressor's step: no adaptive decision, compute times summed forever"),
    _m("tf-flush-memories-kept", "tensorflow/engine.py",
       "        kept = self._keep_members_if(finite, sent)\n        with tf.control_dependencies(kept):\n"
       "            flat = tf.cast(",
       "        kept = []\n        with tf.control_dependencies(kept):\n            flat = tf.cast(",
       "a TensorFlow dense step keeps the memories it sent (their mass sent twice)"),
    _m("tf-modes-never-assigned", "tensorflow/adaptive.py", "            variable.assign(self._code(label))",
       "            pass", "a decided or forced mode never reaches the traced step's variable"),
    _m("tf-compute-never-timed", "tensorflow/engine.py",
       "return self._compute_s[key].assign_add(tf.cast(seconds, tf.float64))",
       "return self._compute_s[key].assign_add(tf.constant(0.0, tf.float64))",
       "a TensorFlow bucket's compute taken as free: the switch sends buckets dense on no evidence"),
    # The GPU's Triton kernels (their tests run them under Triton's interpreter on the CPU)
    _m("triton-pack-fields-high-bit-first", "torch/kernels/triton_bits.py",
       "packed |= ((value >> (bit % WIDTH)) & 1) << j", "packed |= ((value >> (bit % WIDTH)) & 1) << (7 - j)",
       "a message's low-bit fields packed highest bit of each byte first, where the decode reads lowest first"),
    _m("triton-set-bits-byte-words", "torch/kernels/triton_bits.py",
       "tl.atomic_or(words + (position >> 5), bit, mask=inside)",
       "tl.atomic_or(words + (position >> 3), bit, mask=inside)",
       "a position's bit set in the word of its byte's number (bytes taken for 32-bit words)"),
    _m("triton-elias-fano-count-not-carried", "torch/kernels/triton_bits.py",
       "seen += tl.sum(is_set.to(tl.int64), 0)", "seen = tl.sum(is_set.to(tl.int64), 0)",
       "a row's set bits counted afresh in each step of its scan, so a long row's later marks land in its first slots"),
    _m("triton-message-marks-without-rank", "torch/kernels/triton_messages.py",
       "mark = (position >> low_bits) + i if INDEX == 2 else position", "mark = (position >> low_bits) if INDEX == 2 else position",
       "a message's Elias-Fano marks set at each position's high part without its rank, so equal high parts share a bit"),
    _m("triton-header-step-within-its-bounds", "torch/kernels/triton_messages.py",
       "fits = tl.where(w == STEP_AT, words == step_word, (words >= low) & (words <= high))",
       "fits = (words >= low) & (words <= high)",
       "the kernels' header check compares the step word with its table's bounds (0), not with "
       "the step: a message of another step accepted"),
    _m("triton-header-failure-uncounted", "torch/kernels/triton_messages.py",
       "tl.atomic_add(failures, wrong)", "tl.atomic_add(failures, 0)",
       "a header that fails its check is not counted, so nothing names it"),
    _m("triton-header-flags-of-the-count", "torch/kernels/triton_messages.py",
       "flag = tl.sum(tl.where(w == FLAGS_AT, words, 0), 0)",
       "flag = tl.sum(tl.where(w == COUNT_AT, words, 0), 0)",
       "a message's flags read from its count word"),
    _m("triton-message-bfloat16-truncated", "torch/kernels/triton_messages.py",
       "top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16", "top = bits >> 16",
       "bfloat16 values truncated on the wire where the composition rounds to nearest even"),
    _m("triton-keys-sign-kept", "torch/kernels/triton_selection.py",
       "tl.where(mask, (bits & 0x7FFFFFFF).to(tl.int64) + 1, 0)", "tl.where(mask, bits.to(tl.int64) + 1, 0)",
       "the sort keys take a value's bits with its sign, so negative entries rank below every positive one"),
    _m("triton-keys-padding-ranked", "torch/kernels/triton_selection.py",
       "inside_and_real = inside & (tl.load(real + i, mask=inside, other=0) != 0)", "inside_and_real = inside",
       "a bucket's padding ranked by its magnitude among the entries, where it should come last"),
    _m("triton-keys-ranked-across-segments", "torch/kernels/triton_selection.py",
       "tl.store(keys + i, tl.load(base + i, mask=inside, other=0) - bits, mask=inside)",
       "tl.store(keys + i, -bits, mask=inside)",
       "the kernel's keys rank a bucket's entries across its segments: one threshold for every tensor"),
    _m("triton-block-keys-segment-end-off-by-one", "torch/kernels/triton_selection.py",
       "real = inside & (tl.load(slot_last + s, mask=inside, other=-1) >= position)",
       "real = inside & (tl.load(slot_last + s, mask=inside, other=-1) + 1 >= position)",
       "a block that crosses a segment's end ranks the next segment's first entry as its segment's own"),
    _m("triton-block-keys-block-start-forgotten", "torch/kernels/triton_selection.py",
       "position = (tl.load(blocks + s // block, mask=inside, other=0) * block",
       "position = (tl.load(blocks + s // block, mask=inside, other=0)",
       "a chosen block's entries placed at its number, not at its first entry"),
    _m("triton-signs-nan-positive", "torch/kernels/triton_signs.py",
       "positive = value >= 0.0", "positive = ~(value < 0.0)",
       "a NaN entry packed as a positive sign, where the composition's comparison packs it negative"),
    _m("triton-signs-padding-negative", "torch/kernels/triton_signs.py",
       "value = tl.load(x + i, mask=inside, other=0.0)", "value = tl.load(x + i, mask=inside, other=-1.0)",
       "the padding past a buffer packed as negative signs, where zeros pack as set bits"),
    _m("triton-sign-decode-scale-per-byte", "torch/kernels/triton_signs.py",
       "scale = tl.load(scales + i // block, mask=inside, other=0.0)\n        value = tl.where(bit == 1",
       "scale = tl.load(scales + i // 8, mask=inside, other=0.0)\n        value = tl.where(bit == 1",
       "each decoded byte of signs takes its own scale, not its block's"),
    _m("triton-sign-decode-sum-dropped", "torch/kernels/triton_signs.py",
       "        if ADD:\n", "        if False:\n",
       "the signs decoded over the sum they should be added to"),
    _m("triton-runs-values-from-the-first-run", "torch/kernels/triton_messages.py",
       "            sources += start\n", "",
       "every owner's message takes its values from the selection's first entries, not from its own run's"),
    _m("triton-runs-raw-base-kept", "torch/kernels/triton_messages.py",
       "other=base).to(tl.int64) - base\n                if INDEX == 0:", "other=base).to(tl.int64)\n                if INDEX == 0:",
       "an owner's raw positions sent as sort keys, its destination's base not taken off"),
    _m("triton-runs-marks-base-kept", "torch/kernels/triton_messages.py",
       "other=base).to(tl.int64) - base\n            mark =", "other=base).to(tl.int64)\n            mark =",
       "an owner's Elias-Fano or bitmap marks set at the sort keys, its destination's base not taken off"),
    _m("triton-runs-count-word-zero", "torch/kernels/triton_messages.py",
       "words = tl.where(w == COUNT_AT, length.to(tl.int32), words)", "words = words",
       "an owner's message says it holds nothing: the run's length never reaches its header"),
    _m("triton-runs-decoded-at-message-start", "torch/kernels/triton_messages.py",
       "            decoded += start\n", "",
       "what receivers decode of each run written over the first run's, so the memories keep the wrong entries"),
    _m("runs-composition-base-kept", "core/wire.py",
       "ops.add(run, -bases[j]) if bases[j] else run", "run",
       "the composition's owner messages carry sort keys, their destination's base not taken off"),
    _m("runs-composition-count-word-kept", "core/wire.py",
       "header = [length if w == COUNT_WORD else word for w, word in enumerate(header)]", "header = list(header)",
       "the composition's owner messages keep the count word they were given, not their run's length"),
    _m("triton-decode-flags-of-a-failed-message", "torch/kernels/triton_messages.py",
       "tl.store(flags + m, tl.where(wrong == 0, flag, 0))\n        tl.store(bad + m, wrong)",
       "tl.store(flags + m, flag)\n        tl.store(bad + m, wrong)",
       "a message that fails its checks still hands on its flags word, which no longer passes through a where"),
    _m("triton-decode-raw-padding-unchecked", "torch/kernels/triton_messages.py",
       "wrong += tl.sum((inside & ((raw < 0) | (raw >= numel))).to(tl.int32), 0)",
       "wrong += tl.sum((inside & (slot < count) & ((raw < 0) | (raw >= numel))).to(tl.int32), 0)",
       "a raw position outside the tensor accepted in a slot past the count, where the composition refuses it"),
    _m("triton-decode-slots-in-received-order", "torch/kernels/triton_messages.py",
       "rows.append(plan_row(layouts[t], offset, m, starts[t] + i * layouts[t].capacity))",
       "rows.append(plan_row(layouts[t], offset, m, sum(layout.capacity for layout in layouts) * i + starts[t] // len(senders)))",
       "the decoded slots laid out sender after sender, so a layout's sum takes other layouts' positions"),
    _m("raw-explanation-of-padded-slots", "core/codecs.py",
       'return ops.cast(parts[0], "int64")  # every slot, past the count too', "return positions",
       "a raw message refused for a position past its count outside the tensor, with an explanation that finds nothing"),
    _m("triton-gaussian-lowest-forgotten", "torch/kernels/triton_selection.py",
       "                lowest = tl.minimum(lowest, t)\n", "",
       "Gaussian-k's final threshold falls back to the first one tried, not the lowest, when too few reach the last"),
    # The C kernels (built again in the copy for each of these)
    _m("kernel-stream-tail-dropped", "torch/kernels/streaming.c",
       "        for (; i < len; ++i)\n            dst[i] = src[i];\n        return;", "        return;",
       "a streamed store leaves the last len % 4 entries of a range unwritten"),
    _m("kernel-candidate-at-bound-missed", "torch/kernels/streaming.c", "        if (a >= c->bound_bits) {",
       "        if (a > c->bound_bits) {", "the memory pass leaves out a candidate exactly at the bound"),
    _m("kernel-chunk-at-bound-skipped", "torch/kernels/streaming.c",
       "if (candidates && m >= candidates->bound_bits)", "if (candidates && m > candidates->bound_bits)",
       "a chunk whose largest entry equals the bound is not searched for candidates"),
    _m("kernel-nesterov-gradient-dropped", "torch/kernels/streaming.c", "b_out[i] = fmaf(x, s, b[i] + u);",
       "b_out[i] = b[i] + u;", "the Nesterov velocity leaves out the gradient's own term"),
    _m("kernel-momentum-factor-dropped", "torch/kernels/streaming.c",
       "float u = fmaf(LOAD(g[i]), s, a[i] * m);", "float u = fmaf(LOAD(g[i]), s, a[i]);",
       "the fused momentum update ignores the momentum factor"),
    _m("kernel-float16-inf-unflagged", "torch/kernels/streaming.c",
       "#define BAD_FLOAT16(v) (((v) & 0x7c00u) == 0x7c00u)", "#define BAD_FLOAT16(v) (((v) & 0x7fffu) > 0x7c00u)",
       "a float16 infinity in the gradient is not reported (only NaN is)"),
    _m("kernel-chunk-crosses-block", "torch/kernels/streaming.c",
       "        if (stat != STAT_NONE && len > block - in_block) len = block - in_block;\n", "",
       "a chunk is not cut at a statistic block's end, so blocks share one statistic"),
    _m("kernel-abs-sum-tail-dropped", "torch/kernels/streaming.c",
       "    for (; i < len; ++i)\n        total += fabs((double)x[i]);\n", "",
       "blocksign's block sums leave out the last len % 8 entries of a chunk"),
    _m("kernel-sign-of-zero-negative", "torch/kernels/streaming.c", "positive = _mm_cmpge_ps(x, zero);",
       "positive = _mm_cmpgt_ps(x, zero);", "the vector sign packing takes sign(0) as -1"),
    _m("kernel-sign-decode-one-scale-per-byte", "torch/kernels/streaming.c",
       "if (at + 8 <= boundary && byte * 8 + 8 <= n) {", "if (byte * 8 + 8 <= n) {",
       "eight signs that straddle two blocks are decoded with the first block's scale"),
    _m("kernel-sum-sparse-buffer-dirty", "torch/kernels/streaming.c",
       "                buffer[messages[m].positions[i] - at] = 0.0f;", "                ;",
       "the decode's chunk buffer keeps a chunk's sums for the next chunk"),
    _m("kernel-range-start-skips-entry", "torch/kernels/streaming.c", "        if (positions[mid] < at)",
       "        if (positions[mid] <= at)", "a thread's range skips an entry at its first position"),
    _m("kernel-segment-top-every-tie", "torch/kernels/selection.c",
       "if (bits[j] > kth || (bits[j] == kth && equal_wanted-- > 0)) {", "if (bits[j] >= kth) {",
       "a segment's picks are its first k candidates at or above its k-th largest, not its largest"),
    _m("kernel-segment-top-digit-off-by-one", "torch/kernels/selection.c",
       "for (; digit > 0 && counts[digit] < need; --digit)", "for (; digit > 0 && counts[digit] <= need; --digit)",
       "the radix selection passes over a digit that holds exactly the entries still needed"),
    _m("kernel-piece-read-from-its-start", "torch/kernels/streaming.c",
       "(const char *)(uintptr_t)address + (size_t)(at - start) * grad_bytes : (const char *)zeros;",
       "(const char *)(uintptr_t)address : (const char *)zeros;",
       "every chunk of a bucket member's gradient is read from the member's first entry"),
    _m("kernel-pieces-without-padding", "torch/kernels/__init__.py",
       "        if offset > end:\n            ends.append(offset)\n            addresses.append(0)\n", "",
       "the padding between a bucket's members is not read as zeros: each member is read from the "
       "previous one's end"),
    _m("kernel-elias-fano-high-unshifted", "torch/kernels/bits.c",
       "int64_t high = i * 8 + __builtin_ctz(byte) - found;", "int64_t high = i * 8 + __builtin_ctz(byte);",
       "Elias-Fano's high part read without subtracting the entry's rank"),
    _m("kernel-elias-fano-last-fields-zero", "torch/kernels/bits.c",
       "                } else if (low_bits) {\n                    low = (int64_t)field_at(lower, low_bits, bit);\n                }",
       "                }", "the low fields within 8 bytes of the end are read as 0"),
    _m("kernel-count-tail-unmasked", "torch/kernels/bits.c",
       "count += __builtin_popcount(packed[full] & ((1u << (n_bits % 8)) - 1u));",
       "count += __builtin_popcount(packed[full]);", "set bits past the bitmap's length are counted"),
    _m("kernel-float16-unclamped", "torch/kernels/bits.c",
       "float v = values[i] > 65504.0f ? 65504.0f : values[i] < -65504.0f ? -65504.0f : values[i];",
       "float v = values[i];", "the C encoder sends a value above 65504 as a float16 infinity"),
    _m("kernel-bfloat16-truncated", "torch/kernels/bits.c",
       "return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);", "return (uint16_t)(u >> 16);",
       "bfloat16 values truncated instead of rounded to nearest even"),
    _m("kernel-int8-truncated", "torch/kernels/bits.c", "float level = nearbyintf(values[i] * inverse);",
       "float level = (float)(int32_t)(values[i] * inverse);", "int8 levels truncated instead of rounded"),
    _m("kernel-block-max-tail-dropped", "torch/kernels/selection.c",
       "        for (; i < block; ++i) {\n            int32_t a = (int32_t)((uint32_t)row[i] & ABS_BITS);\n"
       "            largest = a > largest ? a : largest;\n        }\n", "",
       "a block's maximum leaves out its last block % 8 entries"),
    _m("kernel-collect-at-threshold-missed", "torch/kernels/selection.c", "            if (a >= threshold) {",
       "            if (a > threshold) {", "the block filter's collection leaves out entries equal to the threshold"),
    _m("kernel-count-at-threshold-missed", "torch/kernels/selection.c", "count += fabsf(x[p]) >= threshold;",
       "count += fabsf(x[p]) > threshold;", "the block filter's count leaves out entries equal to the threshold"),
    # Compression between hosts, the sparse all-reduce's overflow, the DDP hook's buckets
    _m("host-average-summed", "torch/hierarchy.py", "averages.append((hvd.allreduce_async_(tensor, op=hvd.Average,",
       "averages.append((hvd.allreduce_async_(tensor, op=hvd.Sum,",
       "a host's workers sum their gradients instead of averaging them", TORCH_HOSTS_TEST),
    _m("host-leader-forwards-own-message", "torch/hierarchy.py",
       "                received = wait(exchange.between_hosts)\n",
       "                wait(exchange.between_hosts)\n                received = exchange.message\n",
       "a host's leader hands its own message to its host instead of what came from the others",
       TORCH_HOSTS_TEST),
    _m("host-reduction-16-bit", "torch/hierarchy.py",
       "tensor = grad.detach().to(REDUCIBLE.get(grad.dtype, grad.dtype), copy=True)",
       "tensor = grad.detach().clone()",
       "a bfloat16 gradient all-reduced inside the host as bfloat16, which Horovod refuses",
       TORCH_HOSTS_TEST),
    _m("host-dense-between-leaders", "torch/compression.py",
       "        if self.hierarchical:\n            from .collectives import HOROVOD\n            return HOROVOD\n",
       "",
       "tensors sent dense averaged between the hosts' leaders only, not over every worker", TORCH_HOSTS_TEST),
    _m("tf-host-average-summed", "tensorflow/hierarchy.py", "hvd.Average", "hvd.Sum",
       "TensorFlow: a host's workers sum their gradients instead of averaging them", TF_HOSTS_TEST),
    _m("tf-host-reduction-16-bit", "tensorflow/hierarchy.py",
       "wide = tf.cast(grad, REDUCIBLE.get(grad.dtype, grad.dtype))", "wide = grad",
       "TensorFlow: a bfloat16 gradient all-reduced inside the host as bfloat16, which Horovod "
       "refuses", TF_HOSTS_TEST),
    _m("sparse-allreduce-bucket-room-of-the-bucket", "core/sparse_allreduce.py",
       "room = method.room_to_owner(k, s.numel, region, world_size)",
       "room = method.room_to_owner(plan.total, bucket.numel, region, world_size)",
       "a bucket's regions given room for the whole bucket's selection, not their tensor's"),
    _m("sparse-allreduce-bucket-overflow-keeps-smallest", "core/sparse_allreduce.py",
       "ops.add(magnitude_bits(ops, ops.gather(x, positions)), 1, 1, 1), 1, -1)",
       "ops.add(magnitude_bits(ops, ops.gather(x, positions)), 1, 1, 1), 1, 1)",
       "a bucket's region over its room sends its smallest selected entries, not its largest"),
    _m("sparse-allreduce-bucket-room-unchecked", "core/sparse_allreduce.py",
       "fits = ops.all_within(counts, 0, tables.group_capacity)", "fits = ops.all_within(counts, 0, counts)",
       "a bucket's region over its room sends all of it while its destination's message has room"),
    _m("sparse-allreduce-bucket-forwards-to-region-0", "core/sparse_allreduce.py",
       "for v in [s.offset + r * o.numel - o.offset] * k)",
       "for v in [s.offset - o.offset] * k)",
       "every owner's forward of a bucket added to each tensor's first region"),
    _m("sparse-allreduce-bucket-last-entries-of-rank-0", "core/sparse_allreduce.py",
       "last_entries=ints(v for _ in range(world) for s, k in zip(bucket.segments, picks)",
       "last_entries=ints(v for _ in range(1) for s, k in zip(bucket.segments, picks)",
       "the caps on where a bucket's forwarded entries land laid out for the first owner's slots only"),
    _m("sparse-allreduce-overflow-keeps-lowest", "core/sparse_allreduce.py",
       "return ops.sort(ops.gather(positions, ops.topk_abs(ops.gather(x, positions), capacity)))[0]",
       "return ops.slice(positions, 0, capacity)",
       "a region over its room keeps its lowest positions, not its largest entries"),
    _m("sparse-allreduce-bucket-room-past-the-end", "core/sparse_allreduce.py",
       "capacity.append(min(room, max(0, min(region, s.numel - j * region))))", "capacity.append(room)",
       "a bucket's message to every owner has room for a tiny tensor, past its end too"),
    _m("alltoall-share-even", "core/collectives.py",
       "[alltoall_chunks(s, world_size, c)[rank] for s, c in zip(sizes, given)]",
       "[s // world_size for s in sizes]",
       "a worker's share of a joined alltoall read as an equal share, whatever its chunks"),
    _m("horovod-alltoall-splits-dropped", "torch/collectives.py",
       "handle = hvd.alltoall_async(message, splits=splits, name=name, process_set=process_set)",
       "handle = hvd.alltoall_async(message, name=name, process_set=process_set)",
       "Horovod's alltoall sends equal chunks whatever the chunks asked"),
    _m("ddp-broadcast-root-of-the-world", "torch/dist_collectives.py",
       "src = root if self.group is None else dist.get_global_rank(self.group, root)", "src = root",
       "the DDP hook on a process group broadcasts from the world's rank of the group's root number",
       "test_ddp_torch.py::test_ddp_on_process_groups_of_part_of_the_world"),
    _m("ddp-rank-of-the-world", "torch/dist_collectives.py",
       "        return dist.get_rank(self.group)", "        return dist.get_rank()",
       "the DDP hook on a process group takes its rank in the world for its rank in the group",
       "test_ddp_torch.py::test_ddp_on_process_groups_of_part_of_the_world"),
    _m("ddp-alltoall-splits-dropped", "torch/dist_collectives.py",
       "input_split_sizes=sizes, group=self.group, async_op=True)",
       "input_split_sizes=None, group=self.group, async_op=True)",
       "the DDP hook's alltoall sends equal chunks whatever the chunks asked"),
    _m("ddp-results-to-first-views", "torch/ddp.py",
       "torch._foreach_copy_([flight.views[position] for position in flight.compressed], results)",
       "torch._foreach_copy_(flight.views[:len(results)], results)",
       "a bucket's compressed averages written over its first views, dense ones among them"),
    _m("row-set-bits-rank-across-rows", "torch/ops.py",
       "return torch.cumsum(x.view(-1, row), 1, dtype=torch.int64).view(-1)",
       "return torch.cumsum(x, 0, dtype=torch.int64)",
       "a set bit's rank counted from the first row, not its own (every rank's decode at once)"),
    _m("where-fill-inverted", "torch/ops.py",
       "return b.masked_fill(pred, a)",
       "return b.masked_fill(pred.logical_not(), a)",
       "the one-operation where() fills the number where the predicate is false"),
    _m("strided-sample-from-zero", "torch/ops.py",
       "return x[offset::stride].contiguous()",
       "return x[::stride].contiguous()",
       "every stride-th entry taken from the first, whatever the offset (flags read as counts)"),
    _m("dense-bucket-average-not-copied", "torch/engine.py",
       "        if averaged.data_ptr() != own.data_ptr():\n            own.copy_(averaged)\n", "",
       "a dense bucket's average that is another tensor not copied into the bucket's buffer, "
       "whose views are handed back: each rank keeps its own gradients"),
    _m("dense-all-one-bucket-for-every-dtype", "torch/engine.py",
       "by_dtype.setdefault(grad.dtype, []).append(i)", "by_dtype.setdefault(None, []).append(i)",
       "dense tensors of several dtypes put in one bucket"),
    _m("dense-all-blames-the-first", "torch/engine.py",
       "return next(s.name for s in bucket.segments if not bool(torch.isfinite(averaged[s.offset:s.end]).all()))",
       "return bucket.segments[0].name",
       "a NaN among dense tensors received as one blamed on the first of them"),
    _m("decode-senders-flags-unordered", "core/wire.py",
       "[t * senders + r for r in range(senders)\n                                                for t in range(len(layouts))]",
       "[r * len(layouts) + t for r in range(senders)\n                                                for t in range(len(layouts))]",
       "the flags of every rank's messages left layout after layout: a flag poisons another tensor"),
    _m("decode-senders-blames-rank-0", "core/wire.py",
       "layout._fail(sender, BAD_POSITIONS",
       "layout._fail(0, BAD_POSITIONS",
       "a corrupted message from any rank blamed on rank 0"),
)


@dataclass(frozen=True)
class Verdict:
    """What became of one mutant: ``caught_by`` the first failing test (None: survived);
    ``stale``: its edit no longer applies."""

    id: str
    layer: str
    bug: str
    caught_by: Optional[str]
    seconds: float
    stale: bool = False


def stale_reason(mutant: Mutant, root: Path = ROOT) -> Optional[str]:
    """Why ``mutant`` cannot be applied to the tree at ``root`` (None: it can)."""
    path = root / mutant.path
    if not path.is_file():
        return f"{mutant.path} does not exist"
    found = path.read_text().count(mutant.old)
    if found != 1:
        return f"its text occurs {found} times in {mutant.path}, not once"
    if mutant.old == mutant.new:
        return "its edit changes nothing"
    return None


def copy_tree(destination: Path) -> None:
    """The working tree's files that git tracks or would track, and the compiled kernels."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    kernels = [str(p.relative_to(ROOT)) for p in (ROOT / "horovod_dgc").rglob("*.so")]
    for name in [n for n in listed if n] + kernels:
        source, target = ROOT / name, destination / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def run_tests(tree: Path, tests: Sequence[str]) -> Tuple[Optional[str], str]:
    """(the first failing test's id, or None when all passed; pytest's output) in ``tree``,
    of ``tests`` that ``make test`` runs."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "not slow", "-q", "-x",
                           "-p", "no:cacheprovider", *[f"tests/{t}" for t in tests]],
                          cwd=tree, env=worker_env(PYTHONPATH=str(tree)), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if proc.returncode == 0:
        return None, proc.stdout
    # A test id may hold spaces (parameters); pytest ends the line with " - " and the error.
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", proc.stdout, re.M)
    return (failed[0] if failed else f"pytest exit {proc.returncode}"), proc.stdout


def try_mutant(mutant: Mutant, tree: Path, tests: Optional[Sequence[str]] = None) -> Verdict:
    """Apply ``mutant`` to the copy at ``tree``, run its layer's tests (or ``tests``), undo it."""
    reason = stale_reason(mutant, tree)
    if reason:
        return Verdict(mutant.id, mutant.layer, reason, None, 0.0, stale=True)
    path = tree / mutant.path
    original = path.read_text()
    built = {so: so.read_bytes() for so in (tree / KERNELS).glob("*.so")} if mutant.compiled else {}
    path.write_text(original.replace(mutant.old, mutant.new))
    started = time.perf_counter()
    try:
        failed_build = build_kernels(tree) if mutant.compiled else None
        if failed_build:
            return Verdict(mutant.id, mutant.layer, f"it does not compile: {failed_build}", None,
                           time.perf_counter() - started, stale=True)
        caught_by, _ = run_tests(tree, tests or mutant.tests)
    finally:
        path.write_text(original)
        for so, content in built.items():
            so.write_bytes(content)
    return Verdict(mutant.id, mutant.layer, mutant.bug, caught_by, time.perf_counter() - started)


def build_kernels(tree: Path) -> Optional[str]:
    """Compile the C kernels of the copy at ``tree`` in place; the compiler's last line when
    that fails, else None. Only a kernel whose source is newer than its build is compiled: the
    mutated one (all three for ``common.h``), since putting a build back leaves it the newer."""
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                          cwd=tree, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode == 0:
        return None
    return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]


def table(verdicts: Sequence[Verdict]) -> str:
    """A Markdown table of ``verdicts``."""
    rows = ["| mutant | layer | the bug | caught by | s |", "|---|---|---|---|---:|"]
    for v in verdicts:
        caught = "**stale**" if v.stale else (f"`{v.caught_by}`" if v.caught_by else "**nothing: survived**")
        rows.append(f"| {v.id} | {v.layer} | {v.bug} | {caught} | {v.seconds:.0f} |")
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated mutant ids (default: all)")
    parser.add_argument("--layer", choices=LAYERS, default=None, help="only this layer's mutants")
    parser.add_argument("--out", default="results/mutation", help="where mutants.md and .json go")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    chosen = [m for m in MUTANTS if (args.layer is None or m.layer == args.layer)
              and (args.only is None or m.id in args.only.split(","))]
    unknown = set(args.only.split(",")) - {m.id for m in MUTANTS} if args.only else set()
    if unknown or not chosen:
        raise SystemExit(f"no such mutants: {sorted(unknown)}" if unknown else "no mutant chosen")
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="horovod_dgc-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        for mutant in chosen:
            verdict = try_mutant(mutant, tree)
            outcome = f"stale: {verdict.bug}" if verdict.stale else verdict.caught_by or "SURVIVED"
            print(f"{verdict.id}: {outcome} ({verdict.seconds:.0f} s)", flush=True)
            verdicts.append(verdict)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutants.md").write_text(table(verdicts) + "\n")
    (out / "mutants.json").write_text(json.dumps([asdict(v) for v in verdicts], indent=1))
    survived = [v.id for v in verdicts if v.caught_by is None]
    print(f"\n{len(verdicts) - len(survived)} of {len(verdicts)} mutants caught; "
          f"survived or stale: {survived or 'none'}; table in {out / 'mutants.md'}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
