"""``ForwardBatch`` and ``ForwardMode``, where the model executor and plugins have always imported them.

Defined in ``engine.layers.forward_batch``, with the layer SDK that reads them: layers and
attention backends sit below the model executor and import the type from there.
"""

from __future__ import annotations

from engine.layers.forward_batch import BatchAttention, ForwardBatch, ForwardMode

__all__ = ["BatchAttention", "ForwardBatch", "ForwardMode"]
