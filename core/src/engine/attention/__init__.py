"""The attention-backend contract every attention plugin implements (docs/plugins-reference.md,
"Attention backends", describes what a backend receives)."""

from engine.attention.base import AttentionBackend, AttentionContext, AttentionLayerInfo
from engine.attention.selection import check_backend_selectable

__all__ = ["AttentionBackend", "AttentionContext", "AttentionLayerInfo", "check_backend_selectable"]
