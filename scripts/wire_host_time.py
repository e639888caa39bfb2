"""Host time to turn a worker's received buffer back into entries (``hypic.parallel.wire.split``) at
the Qwen3.5-9B shape: 18 entries of 1024-token documents (seam 8), on a meta-device buffer, so only
the host work (views, entry objects) is timed. Prints the best of five.

    python scripts/wire_host_time.py
"""

import time

import torch

from hypic.bench.shapes import SHAPES
from hypic.cache.entry import Entry
from hypic.cache.keys import SegmentKey
from hypic.ops.recurrence import Summary
from hypic.parallel.wire import pack, split


def entry(body: int) -> Entry:
    c = SHAPES["qwen3.5-9b"]
    hv, k, kv, hd = c["linear_num_value_heads"], c["linear_key_head_dim"], c["num_key_value_heads"], c["head_dim"]
    conv = 2 * c["linear_num_key_heads"] * k + hv * c["linear_value_head_dim"]
    e = Entry(SegmentKey(bytes(20), body + 8), tuple(range(body + 8)), 8)
    for layer in range(c["num_hidden_layers"]):
        if layer % c["full_attention_interval"] == c["full_attention_interval"] - 1:
            e.keys[layer] = torch.empty(body, kv, hd, dtype=torch.bfloat16, device="meta")
            e.values[layer] = torch.empty(body, kv, hd, dtype=torch.bfloat16, device="meta")
        else:
            e.summaries[layer] = Summary(torch.empty(hv, k, k, device="meta"), torch.empty(hv, k, k, device="meta"))
            e.conv_tails[layer] = torch.empty(3, conv, dtype=torch.bfloat16, device="meta")
    return e


def main() -> None:
    headers = [h for h in pack([entry(1016)])[0] for _ in range(18)]
    buf = torch.empty(sum(h.nbytes for h in headers), dtype=torch.uint8, device="meta")
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        split(headers, buf)
        best = min(best, time.perf_counter() - t0)
    print(f"split of 18 entries at the 9B shape: {1000 * best:.1f} ms host "
          f"({len(headers[0].fields)} tensors per entry)")


if __name__ == "__main__":
    main()
