"""Turning LoRA on for a model runner: the served rank and targets, the backend, the manager."""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.lora.manager import LoraManager

logger = logging.getLogger(__name__)

#: ``--max-lora-rank`` when no start-up adapter says otherwise (adapters come at run time).
DEFAULT_MAX_RANK = 64


def served_rank_and_targets(args: Any) -> tuple[int, set[str]]:
    """``--max-lora-rank`` and ``--lora-target-modules``, defaulting to the start-up adapters'
    largest rank and union of targets (64 and all seven without start-up adapters)."""
    from engine.config import LORA_TARGET_MODULES
    from engine.lora.adapter import startup_lora_shape

    rank, targets = startup_lora_shape(args.lora_paths) if args.lora_paths else (0, set())
    max_rank = args.max_lora_rank or rank or DEFAULT_MAX_RANK
    chosen = set(args.lora_target_modules) or targets or set(LORA_TARGET_MODULES)
    return max_rank, chosen


def create_lora_manager(args: Any, model: torch.nn.Module, platform: Any, dtype: torch.dtype,
                        device: torch.device, layer_range: tuple[int, int]) -> LoraManager:
    """The manager with every LoRA layer attached to ``model`` (slots allocated, empty)."""
    import engine.plugins as plugins

    max_rank, targets = served_rank_and_targets(args)
    backend = plugins.create_lora_backend(args.lora_backend, platform.device_type, args.disable_plugin,
                                          args.plugin_options)
    free_before = platform.memory_info(device)[0] if device.type != "cpu" else 0
    # Each folded layer's replaced weight is given back at once (attach_lora's ``release``), before
    # the KV pool is sized from the device's free memory.
    manager = LoraManager(model, backend, targets, max_rank, args.max_loras_per_batch, dtype, device, layer_range,
                          release=platform.empty_cache)
    _unfuse_activation_quant(model)
    slot_bytes = sum(buf.numel() * buf.element_size() for layer in manager.layers.values()
                     for buf in (layer.a_buffer, layer.b_buffer))
    logger.info("LoRA: backend %s, %d slots of rank %d on %s (%d layers, %.1f MiB)", backend.name,
                args.max_loras_per_batch, max_rank, " ".join(sorted(targets)), len(manager.layers), slot_bytes / 2**20)
    folded = [layer for layer in manager.layers.values() if layer.fold_weight is not None]
    if folded:
        logger.info("LoRA: shrink folded into the base GEMM on %d of %d layers, for batches of %d to %d tokens",
                    len(folded), len(manager.layers), folded[0].fold_min_rows, folded[0].fold_max_rows)
    if device.type != "cpu":
        platform.empty_cache()
        # What the slots (and the folds) took from the device: the slots' bytes when nothing is
        # left behind in the allocator's cache.
        taken = free_before - platform.memory_info(device)[0]
        logger.info("LoRA: device memory taken by the slots%s: %.2f GiB for %.2f GiB of slots",
                    " and folds" if folded else "", taken / 2**30, slot_bytes / 2**30)
    return manager


def _unfuse_activation_quant(model: torch.nn.Module) -> None:
    """A producer (norm, activation) that hands its LoRA-wrapped consumer quantized activations
    hands it plain ones instead: the adapters read the input in the model's dtype."""
    for module in model.modules():
        for producer_name, consumer_name in (getattr(module, "activation_consumers", None) or {}).items():
            try:
                producer, consumer = module.get_submodule(producer_name), module.get_submodule(consumer_name)
            except AttributeError:
                continue
            if getattr(consumer, "lora", None) is not None and getattr(producer, "out_quant", None) is not None:
                producer.out_quant = None
