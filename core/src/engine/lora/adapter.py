"""Reading a PEFT LoRA adapter directory into host tensors, checked against the served model.

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``...) and ``adapter_model.safetensors`` with one ``lora_A`` ([r, in]) and one
``lora_B`` ([out, r]) matrix per adapted projection, named after the base model's module
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). Every problem is a
``LoraAdapterError`` naming the field (or tensor) and the value.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import EngineError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class LoraAdapterError(EngineError):
    """An adapter that cannot be served here, with what is wrong and what is accepted."""


@dataclass
class AdapterConfig:
    """What the engine reads of ``adapter_config.json``."""

    rank: int
    alpha: float
    use_rslora: bool
    #: PEFT module names the adapter targets (from the weights: q_proj, down_proj, ...).
    target_modules: set[str] = field(default_factory=set)

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


@dataclass
class LoraWeights:
    """An adapter read from disk: its config and its matrices by PEFT module path
    (``model.layers.0.self_attn.q_proj``) as (A [r, in], B [out, r]), full (unsharded) size."""

    name: str
    path: str
    config: AdapterConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter_config(path: str) -> dict[str, Any]:
    """``adapter_config.json`` of the directory ``path`` as a dict (errors name the file)."""
    if not os.path.isdir(path):
        raise LoraAdapterError(f"lora_path {path!r}: not a directory; accepted: a PEFT adapter directory "
                               f"({CONFIG_FILE} and {WEIGHTS_FILE})")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoraAdapterError(f"lora_path {path!r}: no {CONFIG_FILE}; accepted: a PEFT adapter directory "
                               "(peft's save_pretrained writes one)")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"lora_path {path!r}: {CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise LoraAdapterError(f"lora_path {path!r}: {CONFIG_FILE}: expected a JSON object")
    return data


def parse_adapter_config(data: dict[str, Any], where: str) -> AdapterConfig:
    """The served subset of a PEFT LoRA config; features that change the math are refused."""
    peft_type = str(data.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraAdapterError(f"{where}: peft_type {data.get('peft_type')!r} is not served; accepted: LORA")
    rank = data.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"{where}: r {rank!r} is invalid; accepted: an integer >= 1")
    alpha = data.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraAdapterError(f"{where}: lora_alpha {alpha!r} is invalid; accepted: a number")
    refused = (("use_dora", data.get("use_dora"), "false"),
               ("bias", None if data.get("bias", "none") == "none" else data.get("bias"), "none"),
               ("modules_to_save", data.get("modules_to_save") or None, "null"),
               ("rank_pattern", data.get("rank_pattern") or None, "{} (one rank for every module)"),
               ("alpha_pattern", data.get("alpha_pattern") or None, "{} (one lora_alpha for every module)"))
    for key, value, accepted in refused:
        if value:
            raise LoraAdapterError(f"{where}: {key} {value!r} is not served; accepted: {accepted}")
    return AdapterConfig(rank=rank, alpha=float(alpha), use_rslora=bool(data.get("use_rslora", False)))


def load_adapter(name: str, path: str, dtype: torch.dtype) -> LoraWeights:
    """Reads the adapter at ``path`` (on the CPU, in ``dtype``); checks its config and that
    every tensor is a lora_A/lora_B pair of rank r on one of the seven projections."""
    from safetensors.torch import load_file

    from engine.config import LORA_TARGET_MODULES

    config = parse_adapter_config(read_adapter_config(path), f"lora_path {path!r}: {CONFIG_FILE}")
    file = os.path.join(path, WEIGHTS_FILE)
    where = f"lora_path {path!r}: {WEIGHTS_FILE}"
    if not os.path.isfile(file):
        raise LoraAdapterError(f"lora_path {path!r}: no {WEIGHTS_FILE}; accepted: a PEFT adapter directory "
                               "saved with safetensors (peft's default)")
    try:
        tensors = load_file(file, device="cpu")
    except Exception as exc:  # a truncated or foreign file: say which
        raise LoraAdapterError(f"{where}: not a readable safetensors file ({exc})") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraAdapterError(f"{where}: tensor {key!r} is not served; accepted: lora_A/lora_B weights of "
                                   f"{', '.join(LORA_TARGET_MODULES)} (no embeddings, biases or extra modules)")
        module = match.group("module")
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in LORA_TARGET_MODULES:
            raise LoraAdapterError(f"{where}: target module {leaf!r} ({key}) is not served; accepted: "
                                   f"{', '.join(LORA_TARGET_MODULES)}")
        halves.setdefault(module, {})[match.group("ab")] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoraAdapterError(f"{where}: {module} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.rank or b.shape[1] != config.rank:
            raise LoraAdapterError(f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                                   f"have rank r={config.rank}; accepted: lora_A [r, in], lora_B [out, r]")
        weights[module] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
        config.target_modules.add(module.rsplit(".", 1)[-1])
    if not weights:
        raise LoraAdapterError(f"{where}: no lora_A/lora_B weights")
    return LoraWeights(name=name, path=path, config=config, weights=weights)


def startup_lora_shape(lora_paths: dict[str, str]) -> tuple[int, set[str]]:
    """(largest rank, union of target modules) of the start-up adapters, from their configs
    (``target_modules`` there may be a list or PEFT's regular expression; the weights decide
    at load time, so a regular expression counts as every module it could name)."""
    from engine.config import LORA_TARGET_MODULES

    rank, targets = 0, set()
    for path in lora_paths.values():
        data = read_adapter_config(path)
        cfg = parse_adapter_config(data, f"lora_path {path!r}: {CONFIG_FILE}")
        rank = max(rank, cfg.rank)
        declared = data.get("target_modules")
        if isinstance(declared, list):
            targets |= {str(m).rsplit(".", 1)[-1] for m in declared} & set(LORA_TARGET_MODULES)
        else:  # a regular expression or "all-linear"
            targets |= set(LORA_TARGET_MODULES)
    return rank, targets


def write_random_adapter(hf_config: Any, out: str, r: int, targets: tuple[str, ...] | list[str], seed: int = 0,
                         alpha: float | None = None, scale: float = 0.02) -> str:
    """Writes a PEFT LoRA adapter of random weights (normal, ``scale``) for a Llama-family model
    of ``hf_config`` (a transformers config or anything with its fields) to ``out``: what
    benchmarks on ``--load-format dummy`` models load, with no base weights or peft needed."""
    from safetensors.torch import save_file

    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(hf_config.num_hidden_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen) * scale
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha if alpha is not None else 2 * r,
              "target_modules": list(targets), "bias": "none", "use_rslora": False}
    with open(os.path.join(out, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return out
