"""Builds a model plugin's module from a Hugging Face directory and loads its weights."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import ModelLoadError
from engine.model_executor.dtypes import resolve_dtype

if TYPE_CHECKING:
    from engine.config import ServerArgs
    from engine.selection import Selection

logger = logging.getLogger(__name__)

__all__ = ["iterate_weights", "load_model", "resolve_dtype", "this_stage_weights"]


def iterate_weights(model_path: str, load_format: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from safetensors (preferred) or PyTorch .bin files."""
    st_files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if st_files and load_format in ("auto", "safetensors"):
        from safetensors import safe_open

        for path in st_files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bin_files = sorted(glob.glob(os.path.join(model_path, "*.bin")))
    if bin_files and load_format in ("auto", "pt"):
        for path in bin_files:
            state = torch.load(path, map_location="cpu", weights_only=True)
            yield from state.items()
        return
    raise ModelLoadError(
        f"--model-path: no weights found in {model_path} for --load-format {load_format} "
        "(expected *.safetensors or *.bin; use --load-format dummy for random weights)"
    )


def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights in [-1e-2, 1e-2], drawn on the parameters' device (fast for 8B models)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.data.uniform_(-1e-2, 1e-2, generator=gen)
        if "scale" in name:  # quantization scales must stay positive
            param.data.abs_().add_(1e-3)


def load_model(args: ServerArgs, model_path: str, config: Any, device: torch.device,
               selection: Selection) -> torch.nn.Module:
    """Builds ``selection``'s model plugin (with its quant config and options, in its dtype) and
    loads weights."""
    quant = selection.quant_config
    # A method that keeps GGUF blocks (the gguf plugin) reads them from the GGUF file itself.
    gguf_file = None
    if getattr(quant, "loads_gguf_blocks", False) and args.load_format != "dummy":
        from engine.model_executor.gguf_loader import gguf_source, not_a_gguf_error

        gguf_file = gguf_source(model_path)
        if gguf_file is None:
            raise not_a_gguf_error(quant.name, args.model_path or model_path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(selection.dtype)
    try:
        with torch.device(device):
            model = selection.create_model(config)
    finally:
        torch.set_default_dtype(previous)
    if args.load_format == "dummy":
        _init_dummy(model, args.random_seed)
        for module in model.modules():
            init = getattr(getattr(module, "quant_method", None), "init_dummy_weights", None)
            if callable(init):  # methods whose parameters are not floats draw their own
                init(module, args.random_seed)
    elif gguf_file is not None:
        from engine.model_executor.gguf_convert import iterate_gguf_blocks

        blocks = iterate_gguf_blocks(gguf_file, config, _gguf_block_names(model), names_dir=model_path)
        model.load_weights(this_stage_weights(model, config, blocks))
    else:
        model.load_weights(this_stage_weights(model, config, iterate_weights(model_path, args.load_format)))
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    # A model deriving tensors from its weights in their final form (DeepSeek's MLA splits kv_b_proj
    # into per-head absorption matrices) does so now, after every quant method has processed them.
    finish = getattr(model, "post_load_weights", None)
    if callable(finish):
        finish()
    if quant is not None:
        from engine.layers.vocab_parallel_embedding import ParallelLMHead

        for module in model.modules():
            if isinstance(module, ParallelLMHead):
                module.projection = quant.get_lm_head_projection(module)
    report = quant.load_report() if quant is not None else None
    if report:
        logger.info(report)
    return model.eval()


def this_stage_weights(model: torch.nn.Module, config: Any,
                       weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of this pipeline stage's layers (all of them without pipelining).

    Tensors under a ``PPMissingLayer`` belong to another stage and are skipped. A tied LM head
    split from its embedding (the last stage of several) gets the embedding's tensor as
    ``lm_head.weight``.
    """
    from engine.layers.pipeline import missing_prefixes

    missing = tuple(f"{p}." for p in missing_prefixes(model))
    if not missing:
        yield from weights
        return
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, tensor in weights:
        if tied and name.endswith("embed_tokens.weight") and "lm_head." not in missing:
            yield "lm_head.weight", tensor
        if not name.startswith(missing):
            yield name, tensor


def _gguf_block_names(model: torch.nn.Module) -> set[str]:
    """Checkpoint names (``....q_proj.weight``) of the weights whose layers take GGUF blocks:
    each such layer's own name, and for a fused layer the projections it stacks."""
    from engine.layers.quantization import FUSED_LAYER_PARTS

    names = set()
    for prefix, module in model.named_modules():
        if not getattr(getattr(module, "quant_method", None), "accepts_gguf_blocks", False):
            continue
        parent, _, leaf = prefix.rpartition(".")
        for part in FUSED_LAYER_PARTS.get(leaf, (leaf,)):
            names.add(f"{parent}.{part}.weight" if parent else f"{part}.weight")
    return names
