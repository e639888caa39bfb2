"""A cold-prefill worker: a process with its own copy of the model on its own device.

It does one thing, the standalone cold prefill (``hypic.engine.cold``), for whatever segments the
engine sends, and hands back their entries. It keeps no cache: the engine's store owns every entry,
because the combine pass reads them on the engine's device.

It is started as ``python -m hypic.parallel.worker HOST PORT RANK`` (a fresh interpreter, never a fork
of the engine, which may hold CUDA state, and never a re-run of the caller's main module, as
multiprocessing's spawn would do), connects back to the engine's listener with the authkey from
``HYPIC_WORKER_AUTHKEY``, says its rank, and receives its arguments in return.

Protocol (engine ↔ worker), control messages over that connection, tensors over torch.distributed:
  worker → its rank;  engine → (rank, world, init method, backend, device, ModelSpec, threads, timeout)
  worker → ("loaded", weight fingerprint) | ("error", message)     after building the model
  both join the process group; worker → a one-element warm-up send (creates the NCCL link)
  engine → ("prefill", [(token ids, seam, key), ...])
  worker → ("done", [Header, ...], {"started"}) once its work is issued  | ("error", message)
  worker → one buffer holding them all (torch.distributed), then ("computed", time) once computed
  engine → ("stop",)
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Connection

import torch
import torch.distributed as dist

from hypic.engine.cold import ColdContext, entry_template
from hypic.models.fingerprint import weight_fingerprint
from hypic.models.layers.fused import fuse_projections
from hypic.parallel.spec import ModelSpec
from hypic.parallel.wire import pack


def serve(rank: int, world: int, init_method: str, backend: str, device: str, spec: ModelSpec,
          conn: Connection, threads: int, timeout_s: float) -> None:
    try:
        torch.set_num_threads(threads)  # the pool shares the host's cores among its processes
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        loaded = spec.build(dev)
        fuse_projections(loaded.model)  # as the engine does: the same kernels, the same numbers
        conn.send(("loaded", weight_fingerprint(loaded.model)))
    except Exception:  # noqa: BLE001 — reported to the engine, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    dist.send(torch.zeros(1, device=dev), dst=0)
    template = None  # the model's entry layout, learned at the first share
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the engine is gone: nothing left to serve
                break
            if msg[0] == "stop":
                break
            try:
                started = time.time()
                with torch.no_grad():
                    template = template or entry_template(loaded.model, dev)
                    ctx = ColdContext(msg[1], dev, template)
                    loaded.model.hidden_states(ctx.input_ids, ctx)
                    headers, buf = pack(ctx.entries)
            except Exception:  # noqa: BLE001 — this request fails, the worker keeps serving
                conn.send(("error", traceback.format_exc()))
                continue
            conn.send(("done", headers, {"started": started}))  # issued: the engine can post its receive
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            computed = time.time()  # before the send, which waits for the engine's receive on the CPU
            dist.send(buf, dst=0)
            conn.send(("computed", computed))
            del buf  # NCCL's send holds the buffer until it has run (the caching allocator records its stream)
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    host, port, rank = argv[0], int(argv[1]), int(argv[2])
    conn = Client((host, port), authkey=bytes.fromhex(os.environ.pop("HYPIC_WORKER_AUTHKEY")))
    conn.send(rank)
    rank, world, init_method, backend, device, spec, threads, timeout_s = conn.recv()
    serve(rank, world, init_method, backend, device, spec, conn, threads, timeout_s)


if __name__ == "__main__":
    main(sys.argv[1:])
