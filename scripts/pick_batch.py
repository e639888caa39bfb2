"""The batch size to train with, from gpu_train_profile.py's sweep lines
("batch N: step X ms, Y tokens/s, peak Z GB"): the fastest whose peak memory is under the limit.

    python scripts/pick_batch.py SWEEP_LOG MAX_GB   → prints N (65536 when no line qualifies)
"""

from __future__ import annotations

import re
import sys


def pick(lines: list[str], max_gb: float, fallback: int = 65536) -> int:
    best, best_rate = fallback, -1.0
    for line in lines:
        m = re.match(r"batch (\d+): step [\d.]+ ms, (\d+) tokens/s, peak ([\d.]+) GB", line)
        if m and float(m.group(3)) < max_gb and float(m.group(2)) > best_rate:
            best, best_rate = int(m.group(1)), float(m.group(2))
    return best


if __name__ == "__main__":
    print(pick(open(sys.argv[1]).read().splitlines(), float(sys.argv[2])))
