"""Whether a model splits across ``tp_size`` x ``pp_size`` (x ``ep_size``) ranks, and the
division layers shard by: checked before any weight loads, with errors naming the flag.
"""

from __future__ import annotations

# The split check needs no torch: it lives with the other start-up checks (``engine config show``
# runs it too) and is re-exported here, beside the division it guards.
from engine.preflight import check_model_parallel

__all__ = ["check_model_parallel", "divide"]


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator
