"""Whether a model splits across ``tp_size`` x ``pp_size`` (x ``ep_size``) ranks, and the
division layers shard by: checked before any weight loads, with errors naming the flag.
"""

from __future__ import annotations

from typing import Any


def check_model_parallel(hf_config: Any, tp_size: int, pp_size: int, ep_size: int = 1) -> None:
    """Raises ``ConfigError`` (one line) when the model cannot be split ``tp_size`` x ``pp_size`` ways.

    The vocabulary never limits ``tp_size``: embedding and LM head rows are padded to a multiple
    of it (the padding rows are zero and their logits are cut off).
    """
    from engine.errors import ConfigError

    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    intermediate = getattr(hf_config, "intermediate_size", None)

    def fits(tp: int) -> bool:
        kv_ok = kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0
        return heads % tp == 0 and kv_ok and (intermediate is None or int(intermediate) % tp == 0)

    if not fits(tp_size):
        accepted = ", ".join(str(t) for t in range(1, heads + 1) if fits(t))
        what = f"{heads} attention heads, {kv_heads} KV heads"
        if intermediate is not None:
            what += f", MLP size {intermediate}"
        raise ConfigError(f"--tp-size: invalid value {tp_size} for this model ({what}): each must split "
                          f"evenly across ranks (KV heads may instead be replicated when fewer than ranks); "
                          f"accepted: {accepted}")
    _check_expert_parallel(hf_config, tp_size, ep_size)
    layers = int(hf_config.num_hidden_layers)
    if pp_size > layers:
        raise ConfigError(f"--pp-size: invalid value {pp_size}; accepted: at most the model's {layers} layers "
                          "(each pipeline stage needs one)")


def _check_expert_parallel(hf_config: Any, tp_size: int, ep_size: int) -> None:
    """A mixture-of-experts model splits its experts ``ep_size`` ways and each expert's
    intermediate features ``tp_size / ep_size`` ways (engine.layers.moe.layer)."""
    from engine.errors import ConfigError

    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    if not experts:
        return
    experts = int(experts)
    if experts % ep_size:
        accepted = ", ".join(str(e) for e in range(1, tp_size + 1) if tp_size % e == 0 and experts % e == 0)
        raise ConfigError(f"--ep-size: invalid value {ep_size} for this model ({experts} experts): the experts must "
                          f"split evenly across expert-parallel ranks; accepted: {accepted}")
    inter = getattr(hf_config, "moe_intermediate_size", None) or getattr(hf_config, "intermediate_size", None)
    if inter is not None and int(inter) % (tp_size // ep_size):
        raise ConfigError(f"--tp-size {tp_size} with --ep-size {ep_size}: each expert's {inter} intermediate features "
                          f"must split evenly over {tp_size // ep_size} ranks; raise --ep-size or lower --tp-size")


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator
