"""Lets the kernels run under Triton 3.6's interpreter with numpy >= 2.4 (CPU tests).

The interpreter keeps every scalar as a one-element array and turns it into a Python int with
``int(array)``, which numpy 2.4 refuses for arrays with a dimension. The attention kernels loop
over ranges whose bounds are loaded from memory (sequence lengths), so each loop would fail. This
module replaces that one conversion; compiled kernels on a GPU are not affected.
"""

from __future__ import annotations

from typing import Any

_applied = False


def patch_interpreter_index() -> None:
    """Makes the interpreter's scalar ``__index__`` take the array's single element (idempotent)."""
    global _applied
    if _applied:
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # another Triton release: nothing known to patch
        _applied = True
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _applied = True
