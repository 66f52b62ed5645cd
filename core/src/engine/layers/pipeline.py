"""Pipeline parallelism in the layer SDK: which layers this stage builds, and what it passes on.

A model declares its decoder layers with ``make_layers`` (it builds only this stage's layers;
the others are ``PPMissingLayer`` placeholders with no parameters, so checkpoint tensors under
them are skipped by the loader), builds its embedding only on the first stage and its final
norm and LM head only on the last (``PPMissingLayer`` elsewhere), and in ``forward``:

- takes ``forward_batch.pp_proxy`` (a ``PPProxyTensors`` from the previous stage) instead of
  embedding the ids when it is not the first stage;
- returns a ``PPProxyTensors`` of its hidden states (and residual) when it is not the last.

The model runner moves these tensors between stages. At pipeline size 1 the helpers build
every layer and the model runs as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed import (
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
)


@dataclass
class PPProxyTensors:
    """What one pipeline stage hands the next: ``[num_tokens, hidden]`` tensors."""

    hidden_states: torch.Tensor
    # The residual stream of pre-norm decoders (None for models that have none).
    residual: torch.Tensor | None = None


class PPMissingLayer(nn.Module):
    """Stands in for a layer another pipeline stage holds; has no parameters, and calling it is a bug."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a PPMissingLayer was called: this layer lives on another pipeline stage")


@dataclass(frozen=True)
class PipelineStage:
    rank: int
    size: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


def pp_stage() -> PipelineStage:
    """This process's pipeline stage (stage 0 of 1 without pipeline parallelism)."""
    return PipelineStage(get_pipeline_model_parallel_rank(), get_pipeline_model_parallel_world_size())


def pp_layer_range(num_layers: int, pp_rank: int | None = None, pp_size: int | None = None) -> tuple[int, int]:
    """``[start, end)`` of the decoder layers on a stage; stages differ by at most one layer
    (the later ones take the remainder: the first stage also embeds, the last projects logits)."""
    rank = get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    size = get_pipeline_model_parallel_world_size() if pp_size is None else pp_size
    return rank * num_layers // size, (rank + 1) * num_layers // size


def make_layers(num_layers: int, make_layer: Callable[[int, str], nn.Module],
                prefix: str) -> tuple[nn.ModuleList, int, int]:
    """(layers, start, end): ``make_layer(index, f"{prefix}.{index}")`` for this stage's layers,
    ``PPMissingLayer`` for the rest, so indices and checkpoint names stay those of the full model."""
    start, end = pp_layer_range(num_layers)
    layers = nn.ModuleList(make_layer(i, f"{prefix}.{i}") if start <= i < end else PPMissingLayer()
                           for i in range(num_layers))
    return layers, start, end


def missing_prefixes(model: nn.Module) -> list[str]:
    """Module names of the model's placeholders (checkpoint tensors under them are not this stage's)."""
    return [name for name, module in model.named_modules() if isinstance(module, PPMissingLayer)]
