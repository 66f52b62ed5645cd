from __future__ import annotations

from engine.testing import KvStorageTierConformance


class TestHostTier(KvStorageTierConformance):
    tier_name = "host"
