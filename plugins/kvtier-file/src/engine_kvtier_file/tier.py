"""``FileTier``: K and V of each token slot stored as one fixed-size record in a file.

Record ``s`` sits at byte ``s * record`` and holds every layer's K, then every layer's V, as
raw bytes (``KvLayout.bytes_per_token`` in all). A write or read sorts its slots and moves each
run of consecutive slots with one ``pwrite``/``pread``, so a prefix (contiguous tier slots, as
the cache allocates them) costs a few system calls. The file is sparse until written, and its
name is removed right after it is opened: the space is the open descriptor's, so no file is left
behind however the process ends. One file per rank and instance: ranks never share a file.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from engine.errors import ConfigError
from engine.mem_cache.kv_tier import KvLayout, KvStorageTier


def _runs(sorted_slots: list[int]) -> list[tuple[int, int]]:
    """(start index, length) of each run of consecutive slot numbers."""
    runs, start = [], 0
    for i in range(1, len(sorted_slots) + 1):
        if i == len(sorted_slots) or sorted_slots[i] != sorted_slots[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs


class FileTier(KvStorageTier):
    def __init__(self, layout: KvLayout, num_tokens: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(layout, num_tokens)
        directory = (options or {}).get("directory") or os.path.join(tempfile.gettempdir(), "engine-kvtier")
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"kvtier_file.directory: invalid value {directory!r} ({exc.strerror}); "
                              "accepted: a writable directory") from None
        self.elem = torch.empty((), dtype=layout.dtype).element_size()
        self.k_bytes = layout.num_kv_heads * layout.head_dim * self.elem
        self.v_bytes = layout.num_kv_heads * layout.v_head_dim * self.elem
        self.record = layout.bytes_per_token()
        fd, self.path = tempfile.mkstemp(prefix=f"kv-tp{layout.tp_rank}-", suffix=".bin", dir=directory)
        self._fd: int | None = fd
        os.unlink(self.path)
        os.ftruncate(fd, (self.size + layout.page_size) * self.record)

    def write(self, slots: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        n = len(slots)
        if n == 0:
            return
        # Widths spelled out: an "mla" layout's V tensors have no elements (reshape(n, -1) refuses them).
        parts = [t.contiguous().view(torch.uint8).reshape(n, t.numel() * t.element_size() // n) for t in (*k, *v)]
        rows = torch.cat(parts, dim=1)
        order = torch.argsort(slots)
        rows = rows[order].numpy()
        ordered = slots[order].tolist()
        for start, length in _runs(ordered):
            os.pwrite(self._fd_or_raise(), rows[start : start + length].tobytes(), ordered[start] * self.record)

    def read(self, slots: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        n = len(slots)
        order = torch.argsort(slots)
        ordered = slots[order].tolist()
        buf = bytearray(n * self.record)
        for start, length in _runs(ordered):
            size = length * self.record
            data = os.pread(self._fd_or_raise(), size, ordered[start] * self.record)
            if len(data) != size:
                raise OSError(f"{self.path}: short read ({len(data)} of {size} bytes)")
            buf[start * self.record : start * self.record + size] = data
        rows = torch.frombuffer(buf, dtype=torch.uint8).reshape(n, self.record) if n else \
            torch.empty((0, self.record), dtype=torch.uint8)
        rows = rows[torch.argsort(order)]  # back to the caller's order
        lay = self.layout
        out, col = [], 0
        for width, dim in [(self.k_bytes, lay.head_dim)] * lay.num_layers + [(self.v_bytes, lay.v_head_dim)] * lay.num_layers:
            chunk = rows[:, col : col + width].contiguous()
            out.append(chunk.view(lay.dtype).reshape(n, lay.num_kv_heads, dim))
            col += width
        return out[: lay.num_layers], out[lay.num_layers :]

    def _fd_or_raise(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"{self.path}: the tier is closed")
        return self._fd

    def close(self) -> None:
        if getattr(self, "_fd", None) is None:  # closed, or __init__ failed before opening
            return
        os.close(self._fd)  # type: ignore[arg-type]
        self._fd = None

    def describe(self) -> str:
        return f"{super().describe()} in {os.path.dirname(self.path)} (an unlinked file)"

    def __del__(self) -> None:
        self.close()
