"""bench.memory: a worker's peak is its own, not the high-water mark it inherits from the process that spawned it."""

import mmap
import multiprocessing as mp
import os
import resource

import pytest

from bench.memory import peak_bytes, reset_peak, rss_bytes

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc (clear_refs, VmHWM)")

MiB = 2**20


def test_peak_follows_an_allocation_and_resets():
    # a fresh anonymous mapping: its pages become resident when touched, whatever malloc keeps (a bytearray may be
    # served from memory the process already holds resident, and then the touch adds nothing to the peak)
    assert reset_peak()
    base = rss_bytes()
    block = mmap.mmap(-1, 64 * MiB)
    block[::4096] = b"\1" * len(block[::4096])  # touch every page
    assert peak_bytes() >= base + 60 * MiB
    block.close()
    assert reset_peak()
    assert peak_bytes() < base + 32 * MiB


def _child_peaks(queue) -> None:
    inherited = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reset_peak()
    queue.put((inherited, peak_bytes(), rss_bytes()))


def test_spawned_worker_does_not_report_its_parents_peak():
    """The failure bench.memory exists for: ``ru_maxrss`` of a spawned child starts at the parent's size."""
    held = bytearray(256 * MiB)
    held[::4096] = b"\1" * len(held[::4096])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_peaks, args=(queue,))
    child.start()
    try:
        inherited, peak, rss = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    # (on Linux the child's ru_maxrss, ``inherited``, is at least the parent's 256 MiB: the pitfall)
    assert peak < 256 * MiB and peak <= rss + 16 * MiB, (
        f"child peak {peak / MiB:.0f} MiB, rss {rss / MiB:.0f} MiB, ru_maxrss {inherited / MiB:.0f} MiB")
    del held
