"""DP attention (``--enable-dp-attention --tp-size N --dp-size N``): attention data-parallel, the
MLPs tensor-parallel across the same N ranks.

Each of the N data-parallel replicas is one process with its own scheduler, requests and KV pool,
and holds the whole attention (MLA's latent KV does not split by heads, so splitting attention
would replicate the KV on every rank; here each rank's pool holds its own requests only). The
replicas also form one process group of N ranks. A model builds each MLP through
``data_parallel_mlp``: the MLP is then split N ways like under ``--tp-size N`` (experts by
``--ep-size``), and each call gathers every rank's tokens, runs the MLP on all of them with the
group's all-reduce, and keeps this rank's rows.

The collectives need every rank inside the same MLP call: the schedulers step in lockstep
(``engine.managers.dp_attention_turns``): whenever any rank has work, each runs exactly one forward
per turn, a rank without a batch an idle one (``idle_forward``: only the MLP calls, with no
tokens of its own).

Outside DP attention every function here is the identity.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from engine.distributed.parallel_state import STATE

#: Tokens of each replica in the current forward (None: not yet gathered in this forward).
_counts: list[int] | None = None


def dp_attention_size() -> int:
    """Replicas whose MLPs run tensor-parallel together (1: DP attention is off)."""
    return STATE.placement.dp_attn_size


@contextlib.contextmanager
def mlp_parallel() -> Iterator[None]:
    """Layers built or run inside see the N replicas as their tensor-parallel group."""
    placement = STATE.placement
    saved = (STATE.tp_rank, STATE.tp_size, STATE.ep_size, STATE.tp_group, STATE.one_shot)
    STATE.tp_rank, STATE.tp_size, STATE.ep_size, STATE.tp_group, STATE.one_shot = (
        placement.dp_attn_rank, placement.dp_attn_size, placement.ep_size, STATE.dp_attn_group, None)
    try:
        yield
    finally:
        STATE.tp_rank, STATE.tp_size, STATE.ep_size, STATE.tp_group, STATE.one_shot = saved


def data_parallel_mlp(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()``, the model's MLP (or MoE) of one layer; under DP attention built split over
    the replicas and called on every replica's tokens (``_gathered_call``). Its parameters keep
    their names, so checkpoints load unchanged."""
    if dp_attention_size() == 1:
        return build()
    with mlp_parallel():
        module = build()
    inner = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return _gathered_call(inner, x)

    module.forward = forward  # type: ignore[method-assign]
    module.dp_attention_mlp = True  # idle_forward finds it
    return module


def begin_forward() -> None:
    """A new forward: its MLPs gather the ranks' token counts again (once, in the first)."""
    global _counts
    _counts = None


def _gathered_call(inner: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    global _counts
    rank, size = STATE.placement.dp_attn_rank, STATE.placement.dp_attn_size
    if _counts is None:
        sizes = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        parts = [torch.empty_like(sizes) for _ in range(size)]
        dist.all_gather(parts, sizes, group=STATE.dp_attn_group)
        _counts = [int(n) for n in torch.cat(parts).tolist()]  # one device-to-host copy
    counts = _counts
    if counts[rank] != x.shape[0]:
        raise RuntimeError(f"DP attention: this forward's MLP got {x.shape[0]} tokens after {counts[rank]}")
    widest = max(counts)
    padded = x.new_zeros((widest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    rows = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(rows, padded, group=STATE.dp_attn_group)
    tokens = torch.cat([r[:n] for r, n in zip(rows, counts, strict=True)])
    with mlp_parallel():
        out = inner(tokens)
    start = sum(counts[:rank])
    return out[start : start + x.shape[0]]


def idle_forward(model: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """A rank without a batch this turn: every MLP of the model, in order, with no tokens of its
    own, so the other ranks' gathers and all-reduces have their partner."""
    begin_forward()
    empty = torch.empty((0, hidden_size), dtype=dtype, device=device)
    for module in model.modules():
        if getattr(module, "dp_attention_mlp", False):
            module(empty)


def check_model_splits_mlps(model: nn.Module) -> None:
    """Raises ``EngineError`` unless the model built its MLPs through ``data_parallel_mlp`` (a model
    that did not would run whole on every replica, in lockstep for nothing)."""
    from engine.errors import EngineError

    if not any(getattr(m, "dp_attention_mlp", False) for m in model.modules()):
        raise EngineError(f"--enable-dp-attention: {type(model).__name__} does not split its MLPs across the "
                          "data-parallel replicas (engine.distributed.data_parallel_mlp); models that do: "
                          "DeepseekV2ForCausalLM, DeepseekV3ForCausalLM")


def turn_flags(busy: bool, stopping: bool) -> tuple[bool, bool]:
    """Whether any replica has work this turn, and whether any was asked to stop (one gloo
    all-reduce; every replica calls it each turn)."""
    import torch.distributed as dist

    flags = torch.tensor([int(busy), int(stopping)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=STATE.dp_attn_cpu_group)
    return bool(flags[0].item()), bool(flags[1].item())


__all__ = ["begin_forward", "check_model_splits_mlps", "data_parallel_mlp", "dp_attention_size", "idle_forward",
           "mlp_parallel", "turn_flags"]
