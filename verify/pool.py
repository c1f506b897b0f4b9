"""A persistent pool of ranks: spawn a process group once, feed it many tasks, never hang.

Each worker joins a gloo (or NCCL) group through a ``FileStore`` in a private temporary directory, then runs
tasks sent by the parent: a task is a picklable top-level callable plus arguments, run on every rank. Workers
assert; the parent reports. Every task has a deadline. A task that raises on any rank, a rank that dies, or
a deadline that passes ends with the whole group killed (so no rank stays stuck in a collective), an error
naming the task and the ranks, with every worker's traceback, and a fresh group on the next task.

    with WorkerPool(world=2) as pool:
        results = pool.run(some_module.fn, args=(1, 2), timeout=30, name="case 7")   # one result per rank
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["PoolError", "PoolsByWorld", "TaskFailure", "WorkerPool", "cores_here", "watch_parent", "yield_cores_to_workers"]

_GRACE_S = 2.0  # after one rank fails, how long the others get to report before the group is killed


@dataclass
class TaskFailure:
    """What went wrong with one task, per rank."""

    name: str
    kind: str  # "error" | "timeout" | "crash"
    ranks: list[int]  # the ranks that raised, hung or died
    details: dict[int, str]  # rank -> traceback or description

    def summary(self) -> str:
        what = {"error": "raised", "timeout": "did not finish before the deadline", "crash": "died"}[self.kind]
        first = f" (rank {self.ranks[0]} first)" if self.kind == "error" and len(self.ranks) > 1 else ""
        return f"{self.name}: rank(s) {self.ranks} {what}{first}"

    def __str__(self) -> str:
        parts = [self.summary()]
        for r in sorted(self.details):
            parts.append(f"--- rank {r} ---\n{self.details[r].rstrip()}")
        return "\n".join(parts)


class PoolError(RuntimeError):
    def __init__(self, failure: TaskFailure):
        super().__init__(str(failure))
        self.failure = failure


# ---- worker side ----------------------------------------------------------------------------------------
_worker_env: dict[str, Any] = {}


def worker_info() -> dict[str, Any]:
    """Inside a pool worker: ``rank``, ``world``, ``backend``, ``device`` and a lazily built ``cp_mesh``."""
    if "cp_mesh" not in _worker_env and _worker_env:
        from torch.distributed.device_mesh import init_device_mesh

        _worker_env["cp_mesh"] = init_device_mesh(_worker_env["device_type"], (_worker_env["world"],))
    return _worker_env


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:  # no /proc: the signal test alone
        return True


def watch_parent(parent_pid: int) -> None:
    """Exit this process when process ``parent_pid`` is gone (run it in a daemon thread), so that no worker outlives
    its run: a pool's workers watch the pool's parent (a forked worker's own parent is the fork server, so the pool's
    parent is watched by its pid), the GPU check's steps the check."""
    while True:
        if not _alive(parent_pid):
            os._exit(3)
        time.sleep(0.5)


def _worker_main(rank: int, world: int, store_path: str, backend: str, conn: Connection, progress, threads: int,
                 parent_pid: int, timeout_s: float, init: Callable[[], None] | None, device_type: str,
                 environ: dict[str, str]) -> None:
    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    # the parent's environment when the pool started (a forked worker would otherwise see the fork server's)
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    _pin(rank, world, device_type)  # before the group starts: gloo's threads keep the rank's core
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    _worker_env.update(rank=rank, world=world, backend=backend, device_type=device_type)
    if init is not None:
        init()
    conn.send(("ready", rank))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            task_id, fn, args, kwargs = msg
            progress[rank] = task_id
            try:
                result = ("ok", fn(*args, **kwargs))
            except BaseException:  # noqa: BLE001 - everything travels back to the parent
                result = ("error", traceback.format_exc())
            progress[rank] = -1
            conn.send((task_id, result))
            # after an error, peers may be stuck in a collective: the parent then kills the group (or keeps it
            # when every rank raised and it was asked to, see WorkerPool)
    finally:
        conn.close()
    os._exit(0)  # skip interpreter teardown (and process-group destruction, which can block on dead peers)


def _pin(rank: int, world: int, device_type: str) -> None:
    """On the CPU, rank ``r`` of a group of two or more runs on one core only: the ``r % n``-th of the ``n`` cores
    the worker may use. A rank blocked in a collective is then woken on its own core, not moved to whichever core
    is idle; with more ranks than cores a tiny collective takes a third to two thirds of the time it takes unpinned
    (docs/verifier.md, "Pools and deadlines"). ``BLOCKDIAG_POOL_PIN=0`` leaves the workers unpinned."""
    if (device_type != "cpu" or world < 2 or os.environ.get("BLOCKDIAG_POOL_PIN", "") == "0"
            or not hasattr(os, "sched_setaffinity")):
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def cores_here() -> int:
    """The cores this process, and the CPU pools it starts, may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ---- parent side ----------------------------------------------------------------------------------------
_STOP = object()

# What the fork server imports once, so that a worker forked from it does not (see _start_context): the third-party
# modules every worker imports, about 4 s of CPU (torch._dynamo: the project's runtime and non-reentrant
# checkpoints import it). None of the project's: an error in its code is raised in a worker and reaches the
# parent's report, as under spawn, instead of stopping the server.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "numpy")


def _start_context(device: str):
    """How a pool's workers start. On the CPU they are forked from multiprocessing's fork server: one process of
    this parent's that imported :data:`PRELOAD` once and holds no thread but OpenBLAS's idle one (fork-safe). For
    CUDA, and with ``BLOCKDIAG_POOL_START=spawn``, each worker is a fresh interpreter (multiprocessing's
    ``spawn``). Either way a worker runs with the parent's environment and ``sys.path`` of the pool's start and
    imports the parent's main module, as a spawned one does."""
    if (device != "cpu" or "forkserver" not in mp.get_all_start_methods()
            or os.environ.get("BLOCKDIAG_POOL_START", "") == "spawn"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts, on the first fork
    return ctx


# How much the verifier's parent lowers its own priority once its CPU pools' fork server runs (see
# yield_cores_to_workers); BLOCKDIAG_PARENT_NICE overrides it, 0 keeps the parent's priority.
PARENT_NICE = 10


def yield_cores_to_workers(device: str = "cpu") -> int:
    """Lower this process's priority below the CPU pools' workers it will start; returns the increment applied (0 when
    none). The ranks of a pool wait for each other at every collective, so a rank that gives its core to the parent
    (which computes the next cases' references meanwhile) stalls the whole group; at a lower priority the parent runs
    in the time the ranks leave idle, and stays ahead of them through the cases already queued. Workers forked from
    the server keep the server's priority, so the server is started first. Spawned workers (CUDA,
    ``BLOCKDIAG_POOL_START=spawn``) would inherit the parent's priority: nothing is done for them. The change lasts
    as long as the process: call it from a program that runs the verifier, not from a library or a test session."""
    text = os.environ.get("BLOCKDIAG_PARENT_NICE", str(PARENT_NICE))
    if not text.strip().isdecimal():  # what int() reads as a whole number (isdigit() also passes "²")
        raise ValueError(f"BLOCKDIAG_PARENT_NICE: expected a nice increment >= 0 (0 = keep the priority), got {text!r}")
    step = int(text)
    if _start_context(device).get_start_method() != "forkserver" or step == 0:
        return 0
    from multiprocessing import forkserver

    forkserver.ensure_running()  # with the preload _start_context set, at the parent's priority of now
    os.nice(step)
    return step


def _feeder(feed: queue.SimpleQueue, conn: Connection) -> None:
    """Send queued messages to one worker until told to stop (or the worker is gone)."""
    while True:
        msg = feed.get()
        if msg is _STOP:
            return
        try:
            if isinstance(msg, bytes):  # a task, pickled once for every rank (see WorkerPool.submit)
                conn.send_bytes(msg)
            else:
                conn.send(msg)
        except (OSError, BrokenPipeError, ValueError):
            return
        if msg is None:
            return

class WorkerPool:
    """``world`` ranks in one process group, reused for many tasks; see the module docstring."""

    def __init__(
        self,
        world: int,
        *,
        backend: str = "gloo",
        threads_per_worker: int | None = None,
        start_timeout: float = 120.0,
        collective_timeout: float = 300.0,
        init: Callable[[], None] | None = None,
        keep_after_uniform_error: bool = False,
        device: str | None = None,
    ) -> None:
        """``init``: a picklable top-level function every worker runs once after joining the group (warm-up
        that belongs to start-up, not to the first task). ``keep_after_uniform_error``: a task that raised on
        every rank (so no rank is left inside a collective) does not cost a respawn; useful where whole
        families of inputs are refused on purpose (judging third-party code). ``device``: where the workers'
        tensors live, ``cpu`` or ``cuda`` (default: ``cuda`` under NCCL, else ``cpu``; gloo carries some
        collectives of CUDA tensors too, staged through host memory)."""
        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu', 'cuda' or None, got {device!r}")
        self.keep_after_uniform_error = keep_after_uniform_error
        # the others' errors may come later than the first on a busy machine: waiting longer for them saves a respawn
        self.error_grace = 5 * _GRACE_S if keep_after_uniform_error else _GRACE_S
        self.world = world
        self.init = init
        self.backend = backend
        self.device = device or ("cuda" if backend == "nccl" else "cpu")
        self.threads = threads_per_worker or max(1, (os.cpu_count() or 1) // world)
        self.start_timeout = start_timeout
        self.collective_timeout = collective_timeout
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._feeds: list[queue.SimpleQueue] = []
        self._dir: str | None = None
        self._next_task = 0
        self.spawns = 0

    # -- lifecycle --
    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        """Start the group (if not running) and wait until every rank has joined it."""
        if self._procs:
            return
        ctx = _start_context(self.device)  # chosen at each start: the environment may have changed
        self._dir = tempfile.mkdtemp(prefix="blockdiag-pool-")  # private (0700): the rendezvous file lives here
        store = os.path.join(self._dir, "store")
        self._progress = ctx.Array("q", [-1] * self.world, lock=False)
        environ = dict(os.environ)  # one snapshot for every rank
        for rank in range(self.world):
            parent_conn, child_conn = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                args=(rank, self.world, store, self.backend, child_conn, self._progress, self.threads, os.getpid(),
                      self.collective_timeout, self.init, self.device, environ),
                daemon=True,
                name=f"blockdiag-rank{rank}",
            )
            p.start()
            child_conn.close()
            self._procs.append(p)
            self._conns.append(parent_conn)
            # a feeder thread per worker sends tasks, so that the parent never blocks on a full pipe while the
            # worker blocks sending results back
            feed: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_feeder, args=(feed, parent_conn), daemon=True).start()
            self._feeds.append(feed)
        self.spawns += 1
        ready = self._collect(lambda msg: msg[0] == "ready", time.monotonic() + self.start_timeout, "pool start")
        if isinstance(ready, TaskFailure):
            self.kill()
            raise PoolError(ready)

    def kill(self) -> None:
        """Kill every worker now and wait for them (no stray processes)."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for feed in self._feeds:
            feed.put(_STOP)
        for c in self._conns:
            c.close()
        self._procs, self._conns, self._feeds = [], [], []
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def close(self) -> None:
        """Stop the workers politely, then make sure they are gone."""
        for feed in self._feeds:
            feed.put(None)
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    # -- tasks --
    def run(
        self,
        fn: Callable,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float,
        name: str = "task",
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results, or raise :class:`PoolError`
        (the group is then killed; the next call respawns it)."""
        out = self.run_many(fn, [(args, kwargs or {})], timeout=timeout, names=[name])
        item = next(out)
        if isinstance(item, TaskFailure):
            raise PoolError(item)
        return item

    def run_many(
        self,
        fn: Callable,
        calls: Sequence[tuple[Sequence[Any], dict[str, Any]]],
        *,
        timeout: float,
        names: Sequence[str],
    ) -> Iterator[list[Any] | TaskFailure]:
        """Send several calls at once (they run back to back on every rank) and yield, in order, each call's
        per-rank results or its :class:`TaskFailure`. ``timeout`` is per call. After a failure the group is
        killed and the remaining calls are not run (the generator stops)."""
        ids = self.submit(fn, calls)
        for task_id, name in zip(ids, names):
            item = self.collect(task_id, timeout=timeout, name=name)
            yield item
            if isinstance(item, TaskFailure):
                return

    def submit(self, fn: Callable, calls: Sequence[tuple[Sequence[Any], dict[str, Any]]]) -> list[int]:
        """Queue calls on every rank without waiting; returns their task ids for :meth:`collect`."""
        self.start()
        ids = list(range(self._next_task, self._next_task + len(calls)))
        self._next_task += len(calls)
        for task_id, (args, kwargs) in zip(ids, calls):
            msg = bytes(ForkingPickler.dumps((task_id, fn, tuple(args), dict(kwargs))))  # once, not once per rank
            for feed in self._feeds:
                feed.put(msg)
        return ids

    def collect(self, task_id: int, *, timeout: float, name: str) -> list[Any] | TaskFailure:
        """Wait (at most ``timeout`` seconds from now) for one submitted call's per-rank results. On a failure
        the group is killed (every later submitted call is lost; kept, with them, after an error raised on every
        rank when ``keep_after_uniform_error``) and the :class:`TaskFailure` is returned."""
        if not self._procs:
            return TaskFailure(name, "crash", [], {-1: "the group was killed by an earlier failure"})
        results = self._collect(lambda msg: msg[0] == task_id, time.monotonic() + timeout, name)
        if isinstance(results, TaskFailure) and not (
            self.keep_after_uniform_error and results.kind == "error" and sorted(results.ranks) == list(range(self.world))
        ):
            self.kill()
        return results

    def _collect(self, match: Callable[[tuple], bool], deadline: float, name: str) -> list[Any] | TaskFailure:
        """Wait for one matching message from every rank (the message's payload is msg[1])."""
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = set(range(self.world))
        by_conn = {c: r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while pending:
            if errors:
                deadline = min(deadline, time.monotonic() + self.error_grace)
            left = deadline - time.monotonic()
            if left <= 0:
                if errors:  # ranks in the order their errors arrived: the first is the likely cause
                    return TaskFailure(name, "error", list(errors), {**errors, **self._stuck(pending)})
                return TaskFailure(name, "timeout", sorted(pending), self._stuck(pending))
            ready = wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending], timeout=left)
            for obj in ready:
                if obj in by_sentinel:
                    r = by_sentinel[obj]
                    if r in pending and not self._conns[r].poll():
                        return TaskFailure(name, "crash", [r], {r: self._exit_detail(r), **errors})
                    continue
                r = by_conn[obj]
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    return TaskFailure(name, "crash", [r], {r: self._exit_detail(r), **errors})
                if not match(msg):
                    continue
                payload = msg[1]
                pending.discard(r)
                if isinstance(payload, tuple) and len(payload) == 2 and payload[0] == "error":
                    errors[r] = payload[1]
                else:
                    results[r] = payload[1] if isinstance(payload, tuple) and payload[0] == "ok" else payload
        if errors:
            return TaskFailure(name, "error", list(errors), errors)
        return [results[r] for r in range(self.world)]

    def _exit_detail(self, rank: int) -> str:
        p = self._procs[rank]
        p.join(timeout=2)
        code = p.exitcode
        if code is None:
            return "the connection to the worker closed while it was still running"
        return f"the process exited with code {code}" + (f" (killed by signal {-code})" if code < 0 else "")

    def _stuck(self, ranks: set[int]) -> dict[int, str]:
        return {
            r: "still inside this task at the deadline (computing, or waiting in a collective for another rank)"
            for r in sorted(ranks)
        }


class PoolsByWorld:
    """One persistent :class:`WorkerPool` per world size (CP size), spawned on first use by :meth:`_spawn`, all
    closed together (a context manager). The verifier's sessions hold their pools this way."""

    def __init__(self) -> None:
        self.pools: dict[int, WorkerPool] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()

    def pool(self, world: int) -> WorkerPool:
        if world not in self.pools:
            self.pools[world] = self._spawn(world)
        return self.pools[world]

    def _spawn(self, world: int) -> WorkerPool:
        raise NotImplementedError
