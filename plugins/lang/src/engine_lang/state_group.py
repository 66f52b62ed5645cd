"""The branches of ``s.fork(n)``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_lang.state import ProgramState


class ProgramStateGroup:
    """The branches of ``s.fork(n)``: indexable, iterable, ``+=`` to all, and ``join``."""

    def __init__(self, branches: list[ProgramState], parent: ProgramState) -> None:
        self.branches = branches
        self.parent = parent
        self._start = {id(b): len(b._text) for b in branches}

    def __getitem__(self, i: int) -> ProgramState:
        return self.branches[i]

    def __len__(self) -> int:
        return len(self.branches)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.branches)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        items = other if isinstance(other, list) else [other] * len(self.branches)
        if len(items) != len(self.branches):
            raise ValueError(f"fork += list: {len(items)} items for {len(self.branches)} branches")
        for branch, item in zip(self.branches, items, strict=True):
            branch += item
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """``gather_variable``: each variable set in the branches becomes a list in the parent;
        ``concate_and_append``: the branches' new text is appended to the parent, in order."""
        for branch in self.branches:
            branch.sync()
        if mode == "gather_variable":
            self.parent.sync()
            names = {n for b in self.branches for n, v in b._variables.items()
                     if n not in self.parent._variables or self.parent._variables[n] is not v}
            for name in sorted(names):
                self.parent._variables[name] = [b._variables.get(name) for b in self.branches]
                self.parent._meta[name] = [b._meta.get(name) for b in self.branches]
        elif mode == "concate_and_append":
            self.parent += "".join(b._text[self._start[id(b)]:] for b in self.branches)
        else:
            raise ValueError(f"join: mode {mode!r} is not accepted; accepted: gather_variable, concate_and_append")
