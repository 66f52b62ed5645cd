"""Images and video in requests: the items a request carries, the model-side interface, the
processing on the tokenizer workers and the runtime that builds input embeddings.

Public API for model plugins: ``MultimodalItem``, ``MultimodalModel``, ``MRopeModel``
(docs/multimodal.md). Importing this package does not import torch.
"""

from __future__ import annotations

from engine.multimodal.interface import MRopeModel, MultimodalModel, is_multimodal, uses_mrope
from engine.multimodal.items import MODALITIES, MultimodalItem, apply_pad_ids, features_hash, pad_ids

__all__ = ["MODALITIES", "MRopeModel", "MultimodalItem", "MultimodalModel", "apply_pad_ids", "features_hash",
           "is_multimodal", "pad_ids", "uses_mrope"]
