"""The scheduler turn of a DP-attention replica (``engine.distributed.dp_attention``).

The replicas' MLPs run tensor-parallel across all of them, so every replica must be inside the
same forward at once. Each loop turn the replicas first agree (one gloo all-reduce) whether any
has work; if one does, each runs exactly one forward: its scheduler's step (which runs at most
one), or, with nothing of its own to run, an idle forward through the MLPs alone. A replica asked
to stop says so in the same exchange, and all stop at that turn. A step that
ran more than one forward would leave the others behind, so the engine refuses the options that
make one (speculative decoding, pipeline parallelism) with DP attention.
"""

from __future__ import annotations

from typing import Any

from engine.distributed.dp_attention import begin_forward, idle_forward, turn_flags


class DPAttentionTurns:
    """Steps ``scheduler`` in lockstep with the other replicas; ``step`` replaces its ``step``."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.forwards = 0
        #: whether some replica had work last turn (then the loop should not block on its socket).
        self.any_busy = False
        runner = scheduler.runner
        for name in ("forward", "forward_hidden"):
            inner = getattr(runner, name, None)
            if inner is not None:
                setattr(runner, name, self._counted(inner))

    def _counted(self, inner: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            self.forwards += 1
            begin_forward()
            return inner(*args, **kwargs)

        return forward

    def step(self, stopping: bool = False) -> bool:
        """One turn; returns True when some replica was asked to stop (``stopping``): then every
        replica stops at this same turn, none left waiting in a collective for one gone."""
        busy = self.scheduler.has_work()
        self.any_busy, stop = turn_flags(busy, stopping)
        if stop:
            return True
        if not self.any_busy:
            return False
        before = self.forwards
        if busy:
            self.scheduler.step()
        ran = self.forwards - before
        if ran == 0:
            runner = self.scheduler.runner
            idle_forward(runner.model, int(runner.hf_config.hidden_size), runner.dtype, runner.device)
        elif ran > 1:
            raise RuntimeError(f"DP attention: a scheduler step ran {ran} forwards; the replicas step one at a time")
        return False


__all__ = ["DPAttentionTurns"]
