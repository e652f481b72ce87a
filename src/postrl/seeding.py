"""Seeds that are the same in every process and Python version: every random choice of a run derives from them.

``stable_hash(*parts)`` hashes any repr-able parts (unlike ``hash``, which is salted per process);
``derive_seed(*parts)`` is a 62-bit seed from them (e.g. ``derive_seed(seed, step, rank, "rollout")``).
"""

from __future__ import annotations

import hashlib
from typing import Any

_HASH_MOD = 2**62


def stable_hash(*parts: Any) -> int:
    """A hash that is the same in every process and Python version (unlike ``hash``)."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def derive_seed(*parts: Any) -> int:
    """A seed in [0, 2**62) derived from ``parts``."""
    return stable_hash(*parts) % _HASH_MOD
