"""What the exchanges actually moved, recorded as they move it (elements and bytes, per call and phase)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["TrafficEntry", "TrafficLog"]


@dataclass(frozen=True)
class TrafficEntry:
    mode: str  # "allgather" | "halo" | "a2a"
    phase: str  # "forward" | "backward"
    sent_elements: int
    recv_elements: int
    element_size: int
    recv_by_source: tuple[int, ...] = ()  # tokens that arrived from each rank (sizes of the received tensors)

    @property
    def sent_bytes(self) -> int:
        return self.sent_elements * self.element_size

    @property
    def recv_bytes(self) -> int:
        return self.recv_elements * self.element_size


class TrafficLog:
    """Thread-safe list of :class:`TrafficEntry` (backward may run on autograd's worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries: list[TrafficEntry] = []

    def record(self, mode: str, phase: str, sent: int, recv: int, element_size: int, recv_by_source: tuple[int, ...] = ()) -> None:
        with self._lock:
            self.entries.append(TrafficEntry(mode, phase, sent, recv, element_size, tuple(recv_by_source)))

    def totals(self, phase: str | None = None) -> dict[str, int]:
        with self._lock:
            rows = [e for e in self.entries if phase is None or e.phase == phase]
        return {
            "calls": len(rows),
            "sent_elements": sum(e.sent_elements for e in rows),
            "recv_elements": sum(e.recv_elements for e in rows),
            "sent_bytes": sum(e.sent_bytes for e in rows),
            "recv_bytes": sum(e.recv_bytes for e in rows),
        }

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
