"""Two-level KV memory: request slots -> token slots -> per-layer K/V tensors.

``ReqToTokenPool`` maps (request slot, position) to a KV slot index.
``TokenToKVPool`` (``MHATokenToKVPool``) holds K and V for every layer, indexed by
KV slot; ``MLATokenToKVPool`` holds one latent row per token and layer instead (multi-head
latent attention: V is the row's leading dims). ``TokenToKVPoolAllocator`` hands out KV slots, page-aligned when the
page size is larger than one. Slot 0 of the KV pool is never handed out: padded
tokens (CUDA-graph padding, dummy decode rows) write there harmlessly.

With ``--kv-cache-dtype fp8_e4m3|fp8_e5m2`` the pool stores K and V as float8: a write
stores ``x / scale`` (clamped to the format's largest finite value, since a float -> fp8
cast overflows to NaN on GPUs), a read is ``stored * scale``, with one float32 scale per
layer for K and one for V (``RadixAttention.k_scale`` / ``v_scale``: the checkpoint's, else 1.0).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import ConfigError

#: ``--kv-cache-dtype`` values that store K/V in another dtype than the activations'.
KV_CACHE_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_FP8_DTYPES = frozenset(KV_CACHE_STORAGE_DTYPES.values())


def resolve_kv_cache_dtype(kv_cache_dtype: str, activation_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for ``--kv-cache-dtype`` ("auto": the activation dtype)."""
    if kv_cache_dtype == "auto":
        return activation_dtype
    try:
        return KV_CACHE_STORAGE_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ConfigError(f"--kv-cache-dtype: invalid value {kv_cache_dtype!r}; accepted: auto, "
                          f"{', '.join(KV_CACHE_STORAGE_DTYPES)}") from None


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in _FP8_DTYPES


def zeroed_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """``torch.zeros(shape)``; on the CPU its pages are zeroed by the kernel when first touched.

    ``torch.zeros`` writes every byte at allocation: for the default model's 512 MiB CPU pool that
    is 0.3-0.6 s of CPU at each start and the whole pool resident, though a short run touches a
    few pages. ``calloc`` (numpy's zeros) maps fresh zero pages instead, faulted in as KV is
    written. Readers see zeros either way.
    """
    import math

    if torch.device(device).type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x / scale`` in ``dtype``, saturating at the format's largest finite value (fp8)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    y = x.float()
    if scale != 1.0:
        y = y / scale
    return y.clamp_(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Stored K/V back in ``dtype`` (``stored * scale``; fp8 widens exactly to any float)."""
    if scale == 1.0 or not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


class ReqToTokenPool:
    """Maps a request slot and a position in that request to a KV slot index."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        # int32 so attention kernels can read it directly.
        self.req_to_token = zeroed_buffer((size, max_context_len), torch.int32, device)
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        """Returns ``need_size`` request slots, or None when too few are free."""
        if need_size > len(self.free_slots):
            return None
        slots, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return slots

    def free(self, slot: int | list[int]) -> None:
        if isinstance(slot, int):
            self.free_slots.append(slot)
        else:
            self.free_slots.extend(slot)

    def write(self, slot: int, start: int, indices: torch.Tensor) -> None:
        """Records ``indices`` as the KV slots of positions ``start..start+len`` of ``slot``."""
        self.req_to_token[slot, start : start + len(indices)] = indices.to(torch.int32)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


class MHATokenToKVPool:
    """Per-layer K and V buffers of shape ``[size + page_size, num_kv_heads, head_dim]``.

    ``dtype`` is the storage dtype: the activation dtype, or a float8 type (``is_fp8``).
    """

    #: the KV layout attention backends read (``AttentionBackendSpec.kv_layouts``).
    kv_layout = "mha"

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        device: str | torch.device,
        v_head_dim: int | None = None,
        start_layer: int = 0,
    ) -> None:
        self.size = size
        # Pipeline parallelism: this pool holds layers start_layer .. start_layer + num_layers - 1.
        self.start_layer = start_layer
        self.page_size = page_size
        self.dtype = dtype
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.num_layers = num_layers
        self.device = device
        self.store_kv: Any = None
        # The first page (slot 0 included) is reserved for padding writes.
        rows = size + page_size
        self.k_buffer = [
            zeroed_buffer((rows, num_kv_heads, head_dim), dtype, device)
            for _ in range(num_layers)
        ]
        self.v_buffer = [
            zeroed_buffer((rows, num_kv_heads, self.v_head_dim), dtype, device)
            for _ in range(num_layers)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id - self.start_layer]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id - self.start_layer], self.v_buffer[layer_id - self.start_layer]

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """Takes the platform's ``store_kv`` kernel (K and V written in one launch) if offered."""
        self.store_kv = kernels.get("store_kv")

    @property
    def is_fp8(self) -> bool:
        """Whether K/V are stored as float8 (readers multiply by the layer's scales)."""
        return is_fp8(self.dtype)

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        """Writes K/V of shape ``[len(loc), num_kv_heads, head_dim]`` at KV slots ``loc``.

        An fp8 pool stores ``k / k_scale`` and ``v / v_scale`` (saturated); other pools ignore
        the scales.
        """
        if cache_k.dtype != self.dtype:
            cache_k = quantize_kv(cache_k, self.dtype, k_scale)
            cache_v = quantize_kv(cache_v, self.dtype, v_scale)
        k_buf, v_buf = self.get_kv_buffer(layer_id)
        if self.store_kv is not None and cache_k.is_cuda:
            self.store_kv(k_buf, v_buf, loc, cache_k, cache_v)
            return
        k_buf[loc] = cache_k
        v_buf[loc] = cache_v

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * elem


class MLATokenToKVPool:
    """Multi-head latent attention's KV: per layer ONE buffer ``[size + page_size, 1, kv_lora_rank +
    rope_dim]`` holding each token's normalised latent ``c_kv`` followed by its rotated ``k_pe``.

    It is read like an MQA pool with a single KV head: ``get_key_buffer`` is the whole row (the
    key of the weight-absorbed form), ``get_value_buffer`` the view of its leading
    ``kv_lora_rank`` dims (V is the latent itself, stored once). An fp8 pool stores
    ``row / k_scale`` and readers multiply V by ``k_scale`` too (the layer's ``v_scale`` is unused).
    """

    kv_layout = "mla"

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int, rope_dim: int,
                 num_layers: int, device: str | torch.device, start_layer: int = 0) -> None:
        self.size = size
        self.start_layer = start_layer
        self.page_size = page_size
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        # The MHA pool's shape attributes, as an MQA reader sees this pool.
        self.num_kv_heads = 1
        self.head_dim = kv_lora_rank + rope_dim
        self.v_head_dim = kv_lora_rank
        self.num_layers = num_layers
        self.device = device
        self.store_kv: Any = None  # the platform's store_kv writes separate K and V: not used here
        rows = size + page_size  # the first page (slot 0 included) takes padding writes
        self.k_buffer = [zeroed_buffer((rows, 1, self.head_dim), dtype, device) for _ in range(num_layers)]
        self.v_buffer = [buf[..., :kv_lora_rank] for buf in self.k_buffer]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id - self.start_layer]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """No platform kernel writes this layout; one indexed copy per layer stores the row."""

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Writes rows ``cache_k`` ``[len(loc), 1, kv_lora_rank + rope_dim]`` at KV slots ``loc``;
        ``cache_v`` (the same rows' leading dims, or None) and ``v_scale`` are ignored."""
        if cache_k.dtype != self.dtype:
            cache_k = quantize_kv(cache_k, self.dtype, k_scale)
        self.get_key_buffer(layer_id)[loc] = cache_k.view(-1, 1, self.head_dim)

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.head_dim * elem


class TokenToKVPoolAllocator:
    """Hands out KV slot indices ``1..size``; page-aligned when ``page_size > 1``.

    With pages, a request's tokens fill its last page before a new page is taken,
    so position ``p`` of a request always sits at offset ``p % page_size`` of a page.
    """

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        if size % page_size:
            size -= size % page_size
        self.size = size
        self.page_size = page_size
        self.device = device
        self.clear()

    # -- accounting -------------------------------------------------------
    def available_size(self) -> int:
        """Free KV slots (whole free pages times the page size)."""
        return len(self.free_pages) * self.page_size

    def clear(self) -> None:
        # Page 0 (slots 0..page_size-1) is the padding page and never handed out.
        num_pages = self.size // self.page_size
        self.free_pages = torch.arange(1, num_pages + 1, dtype=torch.int64, device=self.device)
        # Freed slots are appended in whatever order requests finished; prefills sort the list
        # first so a prompt's KV lands in ascending, mostly contiguous slots (attention reads
        # it faster than KV scattered slot by slot).
        self._unsorted = False

    # -- allocation -------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocates ``need_size`` slots; with pages, ``need_size`` must be a page multiple."""
        if self.page_size == 1:
            if need_size > len(self.free_pages):
                return None
            out = self.free_pages[:need_size]
            self.free_pages = self.free_pages[need_size:]
            return out
        assert need_size % self.page_size == 0, "paged alloc needs whole pages"
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        return self._pages_to_slots(pages)

    def alloc_extend(
        self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]
    ) -> torch.Tensor | None:
        """Slots for tokens ``prefix_len..seq_len`` of each request, in order.

        ``last_locs[i]`` is the KV slot of request i's token at ``prefix_len - 1``
        (ignored when ``prefix_len == 0``); new tokens continue that page first.
        """
        total = sum(s - p for p, s in zip(prefix_lens, seq_lens, strict=True))
        if self._unsorted and total > len(seq_lens):
            # A prefill (more new tokens than rows); decode steps skip this per-step sort.
            self.free_pages = torch.sort(self.free_pages).values
            self._unsorted = False
        if self.page_size == 1:
            return self.alloc(total)
        ps = self.page_size
        new_pages_needed = sum(
            (s + ps - 1) // ps - (p + ps - 1) // ps for p, s in zip(prefix_lens, seq_lens, strict=True)
        )
        pages = self._take_pages(new_pages_needed)
        if pages is None:
            return None
        out: list[torch.Tensor] = []
        cursor = 0
        for prefix_len, seq_len, last_loc in zip(prefix_lens, seq_lens, last_locs, strict=True):
            pieces = []
            pos = prefix_len
            if prefix_len % ps and seq_len > prefix_len:
                # Continue the partially filled last page.
                fill = min(ps - prefix_len % ps, seq_len - prefix_len)
                pieces.append(torch.arange(last_loc + 1, last_loc + 1 + fill, device=self.device))
                pos += fill
            n_pages = (seq_len - pos + ps - 1) // ps
            if n_pages:
                slots = self._pages_to_slots(pages[cursor : cursor + n_pages])[: seq_len - pos]
                pieces.append(slots)
                cursor += n_pages
            if pieces:
                out.append(torch.cat(pieces))
        if not out:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(out)

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """One slot per request for the token at position ``seq_len - 1``."""
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_locs)

    def free(self, indices: torch.Tensor) -> None:
        """Frees KV slots; with pages, a page is freed once when any of its slots is given."""
        if indices.numel() == 0:
            return
        indices = indices.to(device=self.device, dtype=torch.int64)
        self._unsorted = True
        if self.page_size == 1:
            self.free_pages = torch.cat((self.free_pages, indices))
        else:
            pages = torch.unique(indices // self.page_size)
            self.free_pages = torch.cat((self.free_pages, pages))

    # -- helpers ----------------------------------------------------------
    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_pages):
            return None
        pages = self.free_pages[:n]
        self.free_pages = self.free_pages[n:]
        return pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)
