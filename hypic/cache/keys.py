"""Content keys of cached segments.

A segment's entry depends on the model, the seam width, the dtype and the token ids, never on
where the segment sits in a prompt: that is what makes the cache position-independent. An
optional tenant ``cache_salt`` keeps tenants apart (equal content under different salts never
shares an entry). The full token ids are kept with the entry and compared on every hit, so a hash
collision can never serve the wrong segment.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class SegmentKey:
    digest: bytes
    length: int

    def __str__(self) -> str:
        return self.digest.hex()[:16]


def segment_key(token_ids: list[int], *, model_fingerprint: str, seam: int, dtype: str, salt: str | None = None,
                mode: str = "hypic") -> SegmentKey:
    h = hashlib.blake2b(digest_size=20)
    for part in (model_fingerprint, str(seam), dtype, salt or "", mode):
        encoded = part.encode()
        h.update(struct.pack("<I", len(encoded)) + encoded)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return SegmentKey(h.digest(), len(token_ids))
