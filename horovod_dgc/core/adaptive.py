"""Compression that steps aside where it does not pay: each bucket's predicted time
compressed and dense, and the decision between them (docs/algorithms.md#adaptive).

A bucket's compressed exchange costs its compute (compress and decode, measured on this
machine) plus its collectives' bytes over the link; its dense exchange costs an averaging
all-reduce of the whole bucket. The link is a latency per collective plus a time per byte
each worker sends through its NIC (``collectives.network_bytes``: Gloo's ring collectives),
measured by probes or given by hand. Every rank feeds the same averaged measurements to
:func:`decide`, so every rank takes the same decision at the same step.

The model is serial: it does not credit either mode with overlapping the backward pass, so
it favours neither. A switch moves a bucket's whole pending update (its memories) into the
first dense step (``Method.flush_bucket``), so that nothing is lost.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from .collectives import ALLREDUCE, network_bytes
from .validation import optional_positive, require_momentum, require_non_negative, require_positive_int

COMPRESSED, DENSE = "compressed", "dense"
MODES = (COMPRESSED, DENSE)
# The key under which a compressor's state (its checkpoint) carries its buckets' modes.
STATE_KEY = "adaptive"

# Timed runs of each probe at a decision, after a first that is not counted (it may pay for
# Horovod's negotiation of a name it has not seen). Their mean counts: a collective waits for
# Horovod's next cycle, anywhere from none of it to all of it, as the exchanges of a step do.
PROBE_REPEATS = 2
# The first large probe's bytes (at most the largest bucket's): enough to see a network's rate
# past its latency (a 25 MB probe would take seconds on a slow link).
PROBE_BYTES = 4 * 2 ** 20
# A link on which the largest bucket's all-reduce is predicted under this is probed at that size.
FULL_PROBE_BELOW_S = 0.5


@dataclass(frozen=True)
class Adaptive:
    """When and how the compressor re-decides each bucket's mode.

    Attributes:
        recheck_steps: optimizer steps between decisions. Each decision costs the link's
            probes (timed all-reduces of one element, of 4 MiB and, on a link fast enough, of
            the largest bucket's size, three runs each; none when ``link_bytes_per_s`` is
            given) and one all-reduce of the measurements.
        first_decision_step: the step of the first decision (after the first steps'
            one-off costs: memory allocation, plans, candidate bounds settling).
        sample_steps: steps before each decision whose compute times are measured; their
            median per bucket is the bucket's compute cost.
        margin: a bucket switches only where the other mode is predicted faster by more than
            this fraction of its current mode's time (hysteresis against noise).
        link_bytes_per_s: the link's rate, bytes per second each worker sends, given by hand:
            no probe is then run. None: measured at every decision.
        latency_s: the time of one collective besides its bytes, with ``link_bytes_per_s``.
        watch_steps: between decisions the ranks average the time their exchanges took to
            finish per step (one all-reduce of one number): over the step after a decision
            (the level of the modes decided), then every this many steps; where it moved by
            ``rescale`` times or more from that level (a link slowed down or freed up), the
            decision runs at once.
        rescale: the change of scale that brings a decision forward, > 1.
    """

    recheck_steps: int = 200
    first_decision_step: int = 20
    sample_steps: int = 5
    margin: float = 0.1
    link_bytes_per_s: Optional[float] = None
    latency_s: float = 0.0
    watch_steps: int = 25
    rescale: float = 2.0

    def __post_init__(self) -> None:
        require_positive_int("recheck_steps", self.recheck_steps)
        require_positive_int("sample_steps", self.sample_steps)
        require_positive_int("first_decision_step", self.first_decision_step)
        if self.sample_steps > min(self.first_decision_step, self.recheck_steps):
            raise ValueError(f"sample_steps ({self.sample_steps}) must be at most first_decision_step "
                             f"({self.first_decision_step}) and recheck_steps ({self.recheck_steps})")
        require_momentum("margin", self.margin)
        optional_positive("link_bytes_per_s", self.link_bytes_per_s)
        require_non_negative("latency_s", self.latency_s)
        require_positive_int("watch_steps", self.watch_steps)
        if not isinstance(self.rescale, (int, float)) or not self.rescale > 1.0:
            raise ValueError(f"rescale must be > 1, got {self.rescale!r}")

    @classmethod
    def of(cls, setting: "bool | Adaptive") -> Optional["Adaptive"]:
        """The settings of a compressor's ``adaptive`` argument (None: off)."""
        if isinstance(setting, Adaptive):
            return setting
        if setting is True:
            return cls()
        if setting is False or setting is None:
            return None
        raise ValueError(f"adaptive must be True, False or an Adaptive(...), got {setting!r}")

    def decides_at(self, step: int) -> bool:
        """Whether the decision runs after optimizer step ``step`` (0-based)."""
        return step >= self.first_decision_step and (step - self.first_decision_step) % self.recheck_steps == 0

    def samples_at(self, step: int) -> bool:
        """Whether step ``step``'s compute times are among the next decision's samples."""
        ahead = step + self.sample_steps
        return any(self.decides_at(s) for s in range(step + 1, ahead + 1))


@dataclass(frozen=True)
class Link:
    """A collective's time: ``latency_s`` plus the bytes each worker sends times
    ``seconds_per_byte``."""

    latency_s: float
    seconds_per_byte: float

    def time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        return self.latency_s + network_bytes(kind, nbytes, world_size) * self.seconds_per_byte

    @classmethod
    def from_probes(cls, small_s: float, large_s: float, large_bytes: int, world_size: int) -> "Link":
        """The link of an all-reduce of one element taking ``small_s`` and one of
        ``large_bytes`` taking ``large_s``."""
        sent = network_bytes(ALLREDUCE, large_bytes, world_size)
        return cls(small_s, max(large_s - small_s, 0.0) / sent if sent else 0.0)

    @classmethod
    def given(cls, settings: Adaptive) -> Optional["Link"]:
        """The link given by hand, if it was."""
        if settings.link_bytes_per_s is None:
            return None
        return cls(settings.latency_s, 1.0 / settings.link_bytes_per_s)


@dataclass(frozen=True)
class BucketCost:
    """What a bucket's two modes move and compute.

    Attributes:
        label: the bucket's collective name.
        dense_bytes: its gradients' bytes (an all-reduce's message).
        exchanges: its compressed collectives and the bytes each worker hands to each
            (``Method.bucket_exchanges``).
        compute_s: seconds per step of its compress and decode on this machine (averaged
            over the ranks).
    """

    label: str
    dense_bytes: int
    exchanges: Tuple[Tuple[str, int], ...]
    compute_s: float

    def predicted_s(self, link: Link, world_size: int) -> Tuple[float, float]:
        """(compressed, dense) seconds per step."""
        compressed = self.compute_s + sum(link.time_s(kind, nbytes, world_size) for kind, nbytes in self.exchanges)
        return compressed, link.time_s(ALLREDUCE, self.dense_bytes, world_size)


@dataclass(frozen=True)
class Decision:
    """A bucket's mode after a decision, and the predictions it was taken on."""

    label: str
    mode: str
    compressed_s: float
    dense_s: float
    step: int

    def __str__(self) -> str:
        saved = abs(self.compressed_s - self.dense_s) * 1e3
        faster = "saved" if (self.mode == DENSE) == (self.dense_s < self.compressed_s) else "lost (within the margin)"
        return (f"{self.label}: {self.mode}, {saved:.2f} ms {faster} per step "
                f"(predicted {self.compressed_s * 1e3:.2f} ms compressed, {self.dense_s * 1e3:.2f} ms dense; "
                f"decided at step {self.step})")


def decide(current: str, compressed_s: float, dense_s: float, margin: float) -> str:
    """The mode after a decision: the other one where it is predicted faster by more than
    ``margin`` of the current mode's time, else the current one."""
    if current == COMPRESSED and dense_s < (1.0 - margin) * compressed_s:
        return DENSE
    if current == DENSE and compressed_s < (1.0 - margin) * dense_s:
        return COMPRESSED
    return current


class Switch:
    """Each bucket's mode, the compute samples of the coming decision, and the decisions
    taken; framework-free (an adapter times the probes and all-reduces the measurements).

    Every bucket starts compressed. A forced mode (:meth:`force`) holds until released;
    decisions go on underneath it and apply once it is.
    """

    def __init__(self, settings: Optional[Adaptive]) -> None:
        self.settings = settings
        self.modes: Dict[str, str] = {}
        self.forced: Dict[str, str] = {}
        self.decisions: Dict[str, Decision] = {}
        self.compute_s: Dict[str, float] = {}  # each bucket's last agreed compute cost
        self._samples: Dict[str, List[float]] = {}
        # The exchanges' seconds per step over the step after the last decision, and the step
        # of the next watch (None: none before the next decision).
        self.level_s: Optional[float] = None
        self.next_watch: Optional[int] = None

    def mode(self, label: str) -> str:
        return self.forced.get(label, self.modes.get(label, COMPRESSED))

    def force(self, mode: Optional[str], labels: Sequence[str]) -> None:
        """Hold ``labels`` in ``mode`` (None: release them to the decisions)."""
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} or None, got {mode!r}")
        for label in labels:
            if mode is None:
                self.forced.pop(label, None)
            else:
                self.forced[label] = mode

    def sample(self, step: int, compute_s: Mapping[str, float]) -> None:
        """Keep step ``step``'s compute seconds per compressed bucket if the next decision
        samples it."""
        if self.settings is None or not self.settings.samples_at(step):
            return
        for label, seconds in compute_s.items():
            if self.mode(label) == COMPRESSED:
                self._samples.setdefault(label, []).append(seconds)

    def local_compute_s(self, labels: Sequence[str]) -> List[float]:
        """This rank's compute cost per bucket of ``labels`` for the decision: the median of
        its samples, else the last agreed one (a dense bucket's), else 0."""
        measured = {label: statistics.median(s) for label, s in self._samples.items() if s}
        return [measured.get(label, self.compute_s.get(label, 0.0)) for label in labels]

    def watches_at(self, step: int) -> bool:
        """Whether the ranks compare their exchanges' time after step ``step``."""
        return self.next_watch is not None and step >= self.next_watch

    def rescaled(self, step: int, exchange_s: float) -> bool:
        """The watch after step ``step``: whether the exchanges' seconds per step since the
        last watch (averaged over the ranks) moved by ``rescale`` times or more from the
        level of the step after the last decision (which the first watch sets)."""
        self.next_watch = step + self.settings.watch_steps
        level, factor = self.level_s, self.settings.rescale
        if level is None or level <= 0.0:
            self.level_s = exchange_s
            return False
        return not level / factor < exchange_s < level * factor

    def decide(self, step: int, costs: Sequence[BucketCost], link: Link, world_size: int) -> List[Decision]:
        """Every bucket's mode from ``costs`` (identical on every rank) and the link."""
        self._samples.clear()
        self.level_s, self.next_watch = None, step + 1
        taken = []
        for cost in costs:
            self.compute_s[cost.label] = cost.compute_s
            compressed_s, dense_s = cost.predicted_s(link, world_size)
            mode = decide(self.modes.get(cost.label, COMPRESSED), compressed_s, dense_s, self.settings.margin)
            self.modes[cost.label] = mode
            taken.append(Decision(cost.label, mode, compressed_s, dense_s, step))
        self.decisions.update((d.label, d) for d in taken)
        return taken

    def lines(self) -> Tuple[str, ...]:
        """Each bucket's mode and why: one line per bucket decided or forced, in label order."""
        labels = sorted(set(self.decisions) | set(self.forced))
        return tuple(f"{label}: {self.forced[label]} (forced)" if label in self.forced
                     else str(self.decisions[label]) for label in labels)

    def state_dict(self) -> dict:
        """Each bucket's mode, the decision it came from, and its last agreed compute cost
        (forced modes are the caller's to set again)."""
        return {"modes": dict(self.modes), "compute_s": dict(self.compute_s),
                "decisions": {label: dataclasses.asdict(d) for label, d in self.decisions.items()}}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Modes saved by :meth:`state_dict` (None: a state saved without them, every bucket
        compressed)."""
        state = state or {}
        self.modes = dict(state.get("modes", {}))
        self.compute_s = dict(state.get("compute_s", {}))
        self.decisions = {label: Decision(**d) for label, d in state.get("decisions", {}).items()}
        self._samples.clear()
        self.level_s, self.next_watch = None, None


class Collectives(Protocol):
    """What the switch's step-end work needs from an adapter's collectives (every rank calls
    them alike, in the same order)."""

    def size(self) -> int:
        """The number of workers now."""

    def rank(self) -> int:
        """This worker's rank now."""

    def mean(self, values: Sequence[float], name: str) -> List[float]:
        """Every rank's ``values`` averaged (float64; the bytes counted in ``stats()``)."""

    def allreduce_s(self, numel: int, name: str) -> float:
        """Seconds this rank waited for one averaging all-reduce of ``numel`` float32 zeros
        on the gradients' path, finished."""


@dataclass(frozen=True)
class BucketTraffic:
    """A bucket's two modes' traffic: its dense all-reduce's bytes and its compressed
    collectives ((kind, bytes each worker hands over), ``Method.bucket_exchanges``)."""

    dense_bytes: int
    exchanges: Tuple[Tuple[str, int], ...]


class StepEnd:
    """The switch's work after every optimizer step, the same in every adapter: the compute
    samples, the decision at its scheduled steps or when the watch sees the exchanges' time
    change scale, the probes of the link and the averaged measurements that make every rank
    decide alike, and rank 0's line for every change of mode."""

    def __init__(self, switch: Switch, collectives: Collectives) -> None:
        self.switch, self.collectives = switch, collectives
        self._exchange_s, self._watched_steps = 0.0, 0
        self._last_step = -1

    @property
    def last_step(self) -> int:
        """The step last ended (-1: none yet)."""
        return self._last_step

    def restore(self, modes: Optional[dict], steps_taken: int) -> None:
        """A checkpoint loaded: the switch's ``modes`` (``Switch.state_dict``, None for a state
        saved without them) after ``steps_taken`` steps, which count as ended (a decision due
        before the checkpoint is not taken again at the first step after it)."""
        self.switch.load_state_dict(modes)
        self._last_step = steps_taken - 1
        self._exchange_s, self._watched_steps = 0.0, 0

    def exchanged(self, seconds: float) -> None:
        """This rank waited ``seconds`` for an exchange to finish (the watch's input)."""
        self._exchange_s += seconds

    def __call__(self, step: int, compute_s: Mapping[str, float],
                 traffic: Callable[[], Mapping[str, BucketTraffic]]) -> List[Decision]:
        """After step ``step``: ``compute_s``, each bucket's compute seconds in it;
        ``traffic``, each bucket's traffic (asked at a decision only). A caller that ends
        several steps at once (Keras' ``steps_per_execution``) gets the decisions due at any
        of them."""
        settings = self.switch.settings
        self.switch.sample(step, compute_s)
        self._watched_steps += 1
        unseen = range(max(self._last_step + 1, step - settings.recheck_steps), step + 1)
        due = any(settings.decides_at(s) for s in unseen)
        self._last_step = step
        if due or (self.switch.watches_at(step) and self._rescaled(step)):
            return self._decide(step, traffic())
        return []

    def _rescaled(self, step: int) -> bool:
        """The watch: the exchanges' seconds per step, averaged over the ranks, against the
        level the switch keeps (every rank alike)."""
        local = self._exchange_s / max(self._watched_steps, 1)
        self._exchange_s, self._watched_steps = 0.0, 0
        return self.switch.rescaled(step, self.collectives.mean([local], "adaptive.watch")[0])

    def _decide(self, step: int, traffic: Mapping[str, BucketTraffic]) -> List[Decision]:
        labels = sorted(traffic)
        link = Link.given(self.switch.settings) or self._probe_link(
            max((t.dense_bytes for t in traffic.values()), default=4))
        agreed = self.collectives.mean(self.switch.local_compute_s(labels), "adaptive.measurements")
        costs = [BucketCost(label, traffic[label].dense_bytes, traffic[label].exchanges, compute_s)
                 for label, compute_s in zip(labels, agreed)]
        before = {label: self.switch.mode(label) for label in labels}
        decisions = self.switch.decide(step, costs, link, self.collectives.size())
        self._exchange_s, self._watched_steps = 0.0, 0
        if self.collectives.rank() == 0:
            for decision in decisions:
                if decision.mode != before[decision.label]:
                    print(f"horovod_dgc: {decision}", file=sys.stderr, flush=True)
        return decisions

    def _probe_link(self, largest_bytes: int) -> Link:
        """The link from timed all-reduces, averaged over the ranks: one element, then
        PROBE_BYTES (at most the largest bucket's bytes); then the largest bucket's size
        itself where that link says it takes under FULL_PROBE_BELOW_S. Where the link is
        memory (one host) a few MiB stay in the caches and read faster per byte than a 25 MB
        bucket; a slow link is not worth a bucket-size probe, and is linear in the bytes."""
        first, world = min(largest_bytes, PROBE_BYTES), self.collectives.size()
        small, large = self.collectives.mean([self._timed(1, "small"), self._timed(first // 4, "large")],
                                             "adaptive.probes")
        link = Link.from_probes(small, large, first, world)
        if largest_bytes > first and link.time_s(ALLREDUCE, largest_bytes, world) < FULL_PROBE_BELOW_S:
            full = self.collectives.mean([self._timed(largest_bytes // 4, "full")], "adaptive.probes.full")[0]
            link = Link.from_probes(small, full, largest_bytes // 4 * 4, world)
        return link

    def _timed(self, numel: int, name: str) -> float:
        """The mean of PROBE_REPEATS timed all-reduces of ``numel`` float32 zeros, after a
        first."""
        seconds = [self.collectives.allreduce_s(numel, f"adaptive.probe.{name}") for _ in range(PROBE_REPEATS + 1)]
        return statistics.mean(seconds[1:])
