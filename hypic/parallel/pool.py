"""The engine's side of segment-level parallelism: scatter a request's cold segments over workers.

Rank 0 is the engine itself (its device, its model); ranks 1 … n−1 are worker processes
(``hypic.parallel.worker``), one per extra device. ``prefill`` routes the distinct cold segments
(``router.assign``), sends each worker its share, runs rank 0's share locally while the workers run
theirs, then receives the workers' entries onto the engine's device (the receive is posted as soon
as a worker has issued its work, so it is queued on the engine's device behind rank 0's own share
and the host never waits on the bytes). Every entry is then exactly
what a local standalone prefill would have produced (the same model, the same kernels, from
position 0 and a zero state), so the combine pass that follows cannot tell where it was computed.

Transfers use torch.distributed point-to-point (NCCL between GPUs — NVLink on one host — and gloo
between CPU processes). The process group is the process's default group, so an engine process
holds at most one pool.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, Listener

import torch
import torch.distributed as dist

from hypic.cache.entry import Entry
from hypic.cache.keys import SegmentKey
from hypic.models.fingerprint import same_weights, weight_fingerprint
from hypic.parallel.router import assign
from hypic.parallel.spec import ModelSpec
from hypic.parallel.wire import split

ColdSegment = tuple[list[int], int, SegmentKey]  # token ids, seam w, key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerLost(RuntimeError):
    """A worker process exited or stopped answering: the pool cannot be used any more."""


def _accept(listener: Listener, procs: dict[int, subprocess.Popen], timeout_s: float) -> Connection:
    """The next worker's connection, or a clear error if a worker exits or none connects (accept()
    itself has no timeout, so it waits in a thread). ``procs``: the workers not connected yet, by
    rank — one that connected and then exited (failing to load) says why in its pipe instead."""
    got: list[Connection] = []
    waiter = threading.Thread(target=lambda: got.append(listener.accept()), daemon=True)
    waiter.start()
    deadline = time.monotonic() + timeout_s
    while waiter.is_alive():
        waiter.join(0.05)
        dead = [(rank, p.returncode) for rank, p in procs.items() if p.poll() is not None]
        if dead and not got:
            raise WorkerLost(f"cold worker {dead[0][0]} exited (code {dead[0][1]}) before connecting")
        if time.monotonic() > deadline:
            raise WorkerLost(f"a cold worker did not connect within {timeout_s:.0f} s")
    return got[0]


def worker_devices(local: torch.device, spec: int | list[str] | list[torch.device]) -> list[torch.device]:
    """The workers' devices: a list as given, or ``n`` meaning the next n GPUs after the engine's
    (or n CPU processes when the engine runs on the CPU)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, list)):
        raise ValueError(f"cold_workers: expected a count or a list of devices, got {spec!r}")
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"cold_workers: expected a count ≥ 0, got {spec}")
        if local.type == "cpu":
            return [torch.device("cpu")] * spec
        first = local.index if local.index is not None else torch.cuda.current_device()
        spec = [f"cuda:{first + 1 + i}" for i in range(spec)]
    devices = []
    for d in spec:
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"cold_workers: {d!r} is not a device") from e
        if dev.type != local.type:
            raise ValueError(f"cold_workers: {dev} is not a {local.type} device like the engine's ({local})")
        if dev.type == "cuda" and (dev.index is None or dev.index >= torch.cuda.device_count()):
            raise ValueError(f"cold_workers: {dev} does not exist ({torch.cuda.device_count()} GPUs here)")
        if dev.type == "cuda" and (dev == local or dev in devices):
            raise ValueError(f"cold_workers: {dev} is used twice (the engine runs on {local})")
        devices.append(dev)
    return devices


def _stop(conns: list[Connection], procs: list[subprocess.Popen], leave_group: bool = False) -> None:
    """Ask the workers to stop, wait for them (then kill what is left), and leave the process group."""
    for conn in conns:
        try:
            conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
    for p in procs:
        try:
            p.wait(timeout=30 if conns else 0)
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
    if leave_group and dist.is_initialized():
        dist.destroy_process_group()


class ColdPool:
    def __init__(self, spec: ModelSpec, local: torch.device, devices: list[torch.device],
                 local_model: torch.nn.Module, policy: str = "lpt", threads: int | None = None,
                 timeout_s: float = 600.0) -> None:
        if dist.is_initialized():
            raise ValueError("cold_workers: this process already has a torch.distributed group (one pool per process)")
        assign([], 1, policy)  # validates the policy name
        self.local, self.policy, self.workers = local, policy, 1 + len(devices)
        self.timeout_s = timeout_s  # for every answer a worker owes (a hung one is lost after it)
        self.timeline: dict[str, object] = {}
        self.handicap = [0.0] * self.workers  # tokens each worker starts behind in LPT (rank 0: none)
        backend = "nccl" if local.type == "cuda" else "gloo"
        threads = threads or max(1, (os.cpu_count() or 1) // self.workers)
        self.closed = True  # until every worker has joined
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        try:
            self._start(spec, devices, local_model, backend, threads, timeout_s)
        except BaseException:
            _stop([], self._procs, leave_group=True)
            raise
        self.closed = False
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._procs, True)

    def _start(self, spec: ModelSpec, devices: list[torch.device], local_model: torch.nn.Module, backend: str,
               threads: int, timeout_s: float) -> None:
        init = f"tcp://127.0.0.1:{_free_port()}"
        authkey = secrets.token_bytes(32)
        env = {**os.environ, "HYPIC_WORKER_AUTHKEY": authkey.hex(), "OMP_NUM_THREADS": str(threads)}
        with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
            host, port = listener.address
            for rank in range(1, self.workers):  # all start at once: imports and model loads overlap
                self._procs.append(subprocess.Popen([sys.executable, "-m", "hypic.parallel.worker", host, str(port),
                                                     str(rank)], env=env))
            conns: dict[int, Connection] = {}
            for _ in devices:
                waiting = {r: p for r, p in enumerate(self._procs, start=1) if r not in conns}
                conn = _accept(listener, waiting, timeout_s)
                rank = conn.recv()  # a worker says which it is: they connect in any order
                conn.send((rank, self.workers, init, backend, str(devices[rank - 1]), spec, threads, timeout_s))
                conns[rank] = conn
            self._conns = [conns[rank] for rank in range(1, self.workers)]
        reference = weight_fingerprint(local_model)
        for rank in range(1, self.workers):
            kind, payload = self._recv(rank, timeout_s)
            if kind == "error":
                raise RuntimeError(f"cold worker {rank} failed to load the model:\n{payload}")
            if not same_weights(reference, payload):  # type: ignore[arg-type]
                raise ValueError(f"cold worker {rank} ({devices[rank - 1]}) loaded different weights "
                                 "than the engine's model")
        dist.init_process_group(backend, init_method=init, rank=0, world_size=self.workers,
                                timeout=timedelta(seconds=timeout_s))
        for rank in range(1, self.workers):
            dist.recv(torch.zeros(1, device=self.local), src=rank)  # warm-up: the links exist from here on

    def _recv(self, rank: int, timeout_s: float, kinds: tuple[str, ...] | None = None) -> tuple[str, object]:
        """Worker ``rank``'s next message, one of ``kinds`` (None: any). Any other is a pool out of
        step with its worker — a message left unread by an earlier call — which it cannot get back
        into: WorkerLost, never a message read as another call's answer."""
        conn = self._conns[rank - 1]
        try:
            if not conn.poll(timeout_s):
                raise WorkerLost(f"cold worker {rank} did not answer within {timeout_s:.0f} s")
            msg = conn.recv()
        except (EOFError, OSError) as e:
            raise WorkerLost(f"cold worker {rank} exited (code {self._procs[rank - 1].poll()})") from e
        if kinds is not None and msg[0] not in kinds:
            raise WorkerLost(f"cold worker {rank} answered {msg[0]!r} where {' or '.join(kinds)} was due: out of step")
        return msg

    def route(self, segments: list[ColdSegment]) -> list[int]:
        """Each segment's rank under the pool's policy (LPT starts each worker at its handicap)."""
        loads = self.handicap if self.policy == "lpt" else None
        owner = assign([len(ids) for ids, _, _ in segments], self.workers, self.policy, loads)
        for rank in set(range(1, self.workers)) - set(owner):
            # learned only from calls it takes part in: one late answer could otherwise shut a worker
            # out for good (its handicap past every request's cold tokens); halved per call it sits out
            self.handicap[rank] *= 0.5
        return owner

    def _learn(self, workers: dict[int, dict[str, float]]) -> None:
        """Update each worker's handicap from one call: the seconds between its finishing (or the
        engine's host turning to it, if later: time spent on rank 0's own work is not the worker's)
        and the engine's host having it, in tokens at the worker's measured rate. Rank 0 has no such
        delay. Equal-cost shares would leave it on the request's critical path; charged in advance,
        it is spent while rank 0 still computes. A moving average (half weight to the newest call)
        rides out one noisy call.

        Not charged: the host's time to issue the combine pass after the last arrival. Measured from
        the engine (session 12, H200 ×2) it read 195–235 ms, because issuing it waits on the device
        (it includes rank 0's remaining compute), and charging it moved ~9 000 tokens to rank 0 and
        cost 60–90 ms per request."""
        for rank, w in workers.items():
            compute = w["computed"] - w["started"]
            if compute <= 0 or w["tokens"] <= 0:
                continue
            late = max(0.0, w["answered"] - max(w["computed"], w["waited_from"]))
            self.handicap[rank] = 0.5 * self.handicap[rank] + 0.5 * late * w["tokens"] / compute

    def _settle(self, timeline: dict) -> None:
        """Take the "computed" stamp each worker of this call owes and learn the handicap from them."""
        for rank, w in timeline["workers"].items():
            w["waited_from"] = time.time()  # the engine's host is free for this worker from here
            msg = self._recv(rank, self.timeout_s, ("computed",))
            w["computed"], w["answered"] = msg[1], time.time()
        self._learn(timeline["workers"])

    def prefill(self, segments: list[ColdSegment], owner: list[int],
                run_local: Callable[[list[ColdSegment]], list[Entry]]) -> list[Entry]:
        """Entries of ``segments`` (input order) on the engine's device; ``owner`` from ``route``.

        Returns once every worker has computed; the entries' bytes may still be on their way (the
        device orders the receives before anything issued later). Returning before the workers had
        computed, so the host issues the combine pass earlier, was tried and bought nothing: the
        combine pass is device-bound behind both shares (docs/benchmarks.md, session 13)."""
        if self.closed:
            raise RuntimeError("the cold pool is closed")
        shares: list[list[int]] = [[] for _ in range(self.workers)]
        for i, r in enumerate(owner):
            shares[r].append(i)
        sent = time.time()
        for rank in range(1, self.workers):
            if shares[rank]:
                try:
                    self._conns[rank - 1].send(("prefill", [segments[i] for i in shares[rank]]))
                except OSError as e:  # its end of the pipe is gone
                    raise WorkerLost(f"cold worker {rank} exited (code {self._procs[rank - 1].poll()})") from e
        out: list[Entry | None] = [None] * len(segments)
        errors: list[str] = []
        timeline: dict = {"sent": sent, "workers": {}, "handicap": [round(h) for h in self.handicap]}
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.local.type == "cuda" else []
        try:
            if shares[0]:
                if events:
                    events[0].record()
                for i, e in zip(shares[0], run_local([segments[i] for i in shares[0]]), strict=True):
                    out[i] = e
                if events:
                    events[1].record()
                    timeline["local_events"] = events  # rank 0's device time, for the bench's timelines
            timeline["local"] = {"documents": len(shares[0]), "tokens": sum(len(segments[i][0]) for i in shares[0])}
        finally:  # every answer a worker owes is taken, even after rank 0's own share failed (an
            # unread one put every later call one message behind): the links stay in step
            try:
                self._collect(shares, out, errors, timeline)
                self.timeline = timeline
                self._settle(timeline)
            except WorkerLost:
                self._abandon()
                raise
        if errors:
            raise RuntimeError("\n".join(errors))
        return out  # type: ignore[return-value]

    def _collect(self, shares: list[list[int]], out: list[Entry | None], errors: list[str], timeline: dict) -> None:
        """Each worker's "done" (or "error") and its entries' bytes, into ``out``."""
        for rank in range(1, self.workers):
            if not shares[rank]:
                continue
            msg = self._recv(rank, self.timeout_s, ("done", "error"))
            if msg[0] == "error":
                errors.append(f"cold worker {rank}:\n{msg[1]}")
                continue
            _, headers, stamps = msg
            buf = torch.empty(sum(h.nbytes for h in headers), dtype=torch.uint8, device=self.local)
            try:
                dist.recv(buf, src=rank)  # NCCL: queued after rank 0's own work; the host goes on
            except RuntimeError as e:  # the backend's error: the peer is gone, the group is broken
                raise WorkerLost(f"cold worker {rank}: its entries did not arrive ({str(e)[:200]})") from e
            for i, e in zip(shares[rank], split(headers, buf), strict=True):
                out[i] = e
            timeline["workers"][rank] = {**stamps, "documents": len(headers), "bytes": buf.numel(),
                                         "tokens": sum(len(h.token_ids) for h in headers)}

    def _abandon(self) -> None:
        """A worker is lost: the pool is over. The others may be blocked mid-transfer, unable to read
        a stop (each would cost ``_stop``'s 30 s grace, under the engine's lock): killed now."""
        self.closed = True
        for p in self._procs:
            if p.poll() is None:
                p.kill()

    def close(self) -> None:
        """Stop the workers and leave the process group (also run when the pool is garbage-collected
        or the interpreter exits, so a pool nobody closed never blocks the next one)."""
        self.closed = True
        self._finalizer()
