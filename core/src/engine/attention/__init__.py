"""The attention-backend contract every attention plugin implements."""

from engine.attention.base import AttentionBackend, AttentionContext, AttentionLayerInfo

__all__ = ["AttentionBackend", "AttentionContext", "AttentionLayerInfo"]
