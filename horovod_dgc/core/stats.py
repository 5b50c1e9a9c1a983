"""Traffic and time counters a compressor keeps, so users can log the achieved ratio."""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class CompressionStats:
    """Totals since the last reset, and per-step means.

    Attributes:
        steps: optimizer steps seen (compress calls of the most frequently compressed tensor).
        bytes_sent: bytes handed to Horovod (messages, placeholders and dense tensors).
        dense_bytes: bytes a dense all-reduce of the same tensors would have handed over.
        network_bytes: bytes this worker sends on the network for what it handed over, by
            the collectives used and the number of workers (``collectives.network_bytes``).
            Horovod's own negotiation is not in it: it runs every ``HOROVOD_CYCLE_TIME``
            whatever is sent, and costs per second, not per message (``make
            cluster-negotiation`` measures it).
        dense_network_bytes: the same for a dense all-reduce of the same tensors.
        elements_sent: values sent by the sparse path (padding excluded).
        elements_compressed: elements of the tensors that went through the sparse path.
        selection_time_s: seconds spent in compress (accumulate, select, encode).
        buckets: with ``adaptive=True``, each bucket's mode and why (``adaptive.Decision``),
            as of the newest decision; a sum of spans keeps the later span's.
    """

    steps: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    network_bytes: float = 0.0
    dense_network_bytes: float = 0.0
    elements_sent: int = 0
    elements_compressed: int = 0
    selection_time_s: float = 0.0
    buckets: Tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        """How many times fewer bytes this worker sends on the network than with a dense
        all-reduce (with one worker, nothing crosses the network: the bytes handed to
        Horovod instead)."""
        if self.dense_network_bytes and self.network_bytes:
            return self.dense_network_bytes / self.network_bytes
        return self.handed_ratio

    @property
    def handed_ratio(self) -> float:
        """Dense bytes over bytes handed to Horovod."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("nan")

    @property
    def density(self) -> float:
        """Fraction of the compressed tensors' elements actually sent."""
        return (self.elements_sent / self.elements_compressed
                if self.elements_compressed else float("nan"))

    @property
    def bytes_sent_per_step(self) -> float:
        return self.bytes_sent / self.steps if self.steps else 0.0

    @property
    def dense_bytes_per_step(self) -> float:
        return self.dense_bytes / self.steps if self.steps else 0.0

    @property
    def network_bytes_per_step(self) -> float:
        return self.network_bytes / self.steps if self.steps else 0.0

    @property
    def selection_time_per_step_s(self) -> float:
        return self.selection_time_s / self.steps if self.steps else 0.0

    def __add__(self, other: "CompressionStats") -> "CompressionStats":
        """Totals of two spans of steps (e.g. epochs) taken one after the other."""
        counts = [f.name for f in dataclasses.fields(self) if f.name != "buckets"]
        return CompressionStats(**{name: getattr(self, name) + getattr(other, name) for name in counts},
                                buckets=other.buckets or self.buckets)

    def summary(self) -> str:
        return (f"{self.steps} steps: {self.bytes_sent_per_step / 1e3:.1f} kB/step handed to "
                f"Horovod ({self.handed_ratio:.1f}x fewer than dense), "
                f"{self.network_bytes_per_step / 1e3:.1f} kB/step sent on the network "
                f"({self.ratio:.1f}x fewer), density {self.density:.4%}, compress "
                f"{self.selection_time_per_step_s * 1e3:.2f} ms/step"
                + "".join(f"\n  {line}" for line in self.buckets))


class StatsRecorder:
    """Thread-safe accumulation (compress runs on PyTorch's autograd thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = CompressionStats()
        self._first_step: Optional[int] = None

    def record(self, *, step: int, bytes_sent: int, dense_bytes: int, network_bytes: float,
               dense_network_bytes: float, elements_sent: int = 0, elements_compressed: int = 0,
               selection_time_s: float = 0.0) -> None:
        with self._lock:
            t = self._totals
            if self._first_step is None:
                self._first_step = step
            self._totals = CompressionStats(
                steps=max(t.steps, step - self._first_step + 1), bytes_sent=t.bytes_sent + bytes_sent,
                dense_bytes=t.dense_bytes + dense_bytes,
                network_bytes=t.network_bytes + network_bytes,
                dense_network_bytes=t.dense_network_bytes + dense_network_bytes,
                elements_sent=t.elements_sent + elements_sent,
                elements_compressed=t.elements_compressed + elements_compressed,
                selection_time_s=t.selection_time_s + selection_time_s)

    def snapshot(self) -> CompressionStats:
        with self._lock:
            return self._totals

    def reset(self) -> None:
        with self._lock:
            self._totals = CompressionStats()
            self._first_step = None
