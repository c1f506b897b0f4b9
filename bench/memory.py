"""Peak resident memory of this process, measured from a point in time (Linux ``/proc``).

``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is not a measure of a spawned worker's own peak: at ``exec`` Linux
carries the high-water mark of the process that forked it into the new program's ``ru_maxrss``, so a worker spawned
by a parent holding 2 GB reports a peak of at least 2 GB before it allocates anything. :func:`reset_peak` clears
the kernel's high-water mark of this process (``/proc/self/clear_refs``: 5) and :func:`peak_bytes` reads it back
(``VmHWM``), so a peak read after a step is the step's own.
"""

from __future__ import annotations

import resource

__all__ = ["peak_bytes", "reset_peak", "rss_bytes"]


def rss_bytes() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak() -> bool:
    """Reset this process's resident high-water mark to its resident memory now; False where the kernel does not
    offer it (then :func:`peak_bytes` is the peak since the process started, inherited part included)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    """This process's resident high-water mark in bytes since the last :func:`reset_peak` (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("expected a VmHWM line in /proc/self/status, got none")
