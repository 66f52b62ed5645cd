"""The hardware-platform contract (CUDA, ROCm, XPU, NPU, CPU).

Platform plugins subclass ``Platform``; the core asks it everything device
specific so that no other module tests for CUDA by hand. This module is the only one
in the core that may call a vendor device module (``torch.cuda``, ``torch.xpu``,
``torch.npu``): the helpers at the bottom (``device_index``, ``device_event``,
``synchronize_device``, ``pin_host_memory``) go through ``torch.get_device_module`` for code that holds a
tensor but not the platform (a test asserts the rest of the core names no ``torch.cuda``).

Hook API 5 added ``device_count``, ``fp8_dtype``, ``unsupported_attention_reason``,
``unsupported_quant_reason``, the stream/event/graph methods and
``set_current_platform``/``current_platform``; each has a default, so platforms written
for API 4 keep working.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)


class Platform(ABC):
    """Probes and policies of one kind of device."""

    #: short name, as in ``--platform``.
    name: str = ""
    #: torch device type ("cuda", "cpu", "xpu", "npu"; ROCm reports "cuda").
    device_type: str = ""

    @abstractmethod
    def is_available(self) -> bool:
        """True when this machine has a usable device of this platform."""

    def unavailable_reason(self) -> str:
        """Why ``is_available()`` is False, for error messages."""
        return "no device found"

    def device_count(self) -> int:
        """Devices of this platform visible to this process (0 when unavailable). Since hook API 5.

        The default asks torch's module for ``device_type`` (``torch.get_device_module``).
        """
        if not self.is_available():
            return 0
        if self.device_type == "cpu":
            return 1
        return int(torch.get_device_module(self.device_type).device_count())

    def device(self, local_rank: int = 0) -> torch.device:
        """The torch device a worker of this local rank runs on."""
        return torch.device(self.device_type, local_rank) if self.device_type != "cpu" else torch.device("cpu")

    def set_device(self, device: torch.device) -> None:
        """Makes ``device`` current for the calling process (no-op where meaningless)."""

    @abstractmethod
    def distributed_backend(self) -> str:
        """torch.distributed backend for collectives ("nccl", "gloo", "hccl", "xccl")."""

    @abstractmethod
    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """(free bytes, total bytes) of device memory available to the engine."""

    @abstractmethod
    def default_attention_backend(self, available: Collection[str]) -> str:
        """Attention backend used when ``--attention`` is not given.

        Args:
            available: the attention backends installed and enabled in this run (hook API 2;
                an implementation may leave the argument out). Never return a name outside it
                when one of yours is in it: the engine fails on a default that is not available.
        """

    def default_mem_fraction_static(self) -> float:
        """Share of device memory for weights + KV pool when ``--mem-fraction-static`` is unset."""
        return 0.85

    def kv_cache_budget(self, free_at_start: int, free_now: int, total: int, weight_bytes: int,
                        fraction: float | None) -> int:
        """Bytes the KV pool may take when ``--max-total-tokens`` is not given.

        Args:
            free_at_start: ``memory_info()[0]`` before the weights were loaded.
            free_now: ``memory_info()[0]`` after the weights were loaded.
            total: ``memory_info()[1]``.
            weight_bytes: bytes of the model's parameters and buffers.
            fraction: ``--mem-fraction-static``; None means the platform's default.

        The default suits a device the engine owns (a GPU, as in SGLang): weights and pool
        together take ``fraction`` of the device, less what other processes held at start.
        A platform whose memory is shared with everything (the CPU) overrides it.
        """
        fraction = fraction or self.default_mem_fraction_static()
        weights = max(0, free_at_start - free_now)
        return int(total * fraction - weights - (total - free_at_start))

    def default_dtype(self) -> torch.dtype:
        """Activation dtype for ``--dtype auto`` when the checkpoint gives none usable."""
        return torch.bfloat16

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return True

    def fp8_dtype(self, device: torch.device | None = None) -> torch.dtype | None:
        """The float8 e4m3 variant this device computes in natively, or None. Since hook API 5.

        CUDA sm_89+ and ROCm gfx950 answer ``torch.float8_e4m3fn`` (OCP), ROCm gfx942 (MI300)
        ``torch.float8_e4m3fnuz``; a device without fp8 arithmetic (CPU, NPU, pre-Ada GPUs)
        None. Quantization plugins ask this instead of assuming a format; None means "fp8
        weights are dequantized, never multiplied as fp8".
        """
        return None

    def unsupported_attention_reason(self, name: str) -> str | None:
        """Why attention backend ``name`` cannot run on this platform, or None when it can.

        Checked after the backend spec's ``device_types``: ROCm reports device type "cuda",
        so a CUDA-only backend (flashinfer) must be refused here. Since hook API 5.
        """
        return None

    def unsupported_quant_reason(self, name: str) -> str | None:
        """Why quantization method ``name`` cannot run on this platform, or None when it can
        (checked after the spec's ``device_types``). Since hook API 5."""
        return None

    def supported_attention_backends(self, available: Collection[str]) -> list[str]:
        """The names in ``available`` this platform does not refuse (spec device types aside)."""
        return [n for n in available if self.unsupported_attention_reason(n) is None]

    def supported_quant_methods(self, available: Collection[str]) -> list[str]:
        """The names in ``available`` this platform does not refuse (spec device types aside)."""
        return [n for n in available if self.unsupported_quant_reason(n) is None]

    def supports_graph_capture(self) -> bool:
        """Whether decode steps can be captured and replayed as device graphs.

        A platform answering True implements ``create_graph`` and ``graph_capture``.
        """
        return False

    # -- streams, events and graphs (hook API 5) ------------------------------
    def create_stream(self) -> Any:
        """A new side stream on the current device (None where the device has no streams)."""
        module = _device_module(self.device_type)
        return module.Stream() if module is not None and hasattr(module, "Stream") else None

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager that makes ``stream`` current (a no-op for None)."""
        module = _device_module(self.device_type)
        if stream is None or module is None or not hasattr(module, "stream"):
            return contextlib.nullcontext()
        return module.stream(stream)  # type: ignore[no-any-return]

    def create_event(self) -> Any:
        """A device event (``record()``, ``synchronize()``), or None where there are none."""
        module = _device_module(self.device_type)
        return module.Event() if module is not None and hasattr(module, "Event") else None

    def create_graph(self) -> Any:
        """A new device graph (``replay()``, ``pool()``); only where ``supports_graph_capture``."""
        raise NotImplementedError(f"platform '{self.name}' does not capture device graphs")

    def graph_capture(self, graph: Any, pool: Any, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager that records the work issued inside it into ``graph`` (memory from
        ``pool``, the previous graph's ``pool()`` or None; on ``stream``)."""
        raise NotImplementedError(f"platform '{self.name}' does not capture device graphs")

    def decode_capture_context(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        """Entered around the model call of each decode graph's capture, inside the capture: a
        platform may add work beside the model's to the graph (the cuda plugin's
        ``cuda.l2_prefetch_mb`` stages upcoming weights in L2). Default: nothing."""
        return contextlib.nullcontext()

    def supports_overlap_schedule(self) -> bool:
        """Whether the CPU can prepare batch N+1 while the device runs batch N."""
        return False

    def layer_kernels(self) -> dict[str, Any]:
        """Fused kernels the layer SDK may use on this platform, by name.

        Known names: ``rms_norm(x, weight, eps, residual=None)``, ``silu_and_mul(x)``,
        ``rotary_inplace(positions, x, cos_cache, sin_cache, head_dim, rotary_dim)``,
        ``rotary_qk_inplace(positions, q, k, cos_cache, sin_cache, head_dim, rotary_dim)``,
        ``store_kv(k_cache, v_cache, loc, k, v)`` (the KV pool's write) and
        ``qkv_prologue(positions, q, k, v, k_cache, v_cache, loc, cos_cache, sin_cache, rotary_dim,
        q_norm_weight=None, k_norm_weight=None, eps=1e-6, k_scale=1.0, v_scale=1.0)``: a decode
        step's attention prologue in one launch (``RadixAttention.forward_qkv``). ``q``
        ``[tokens, heads * head_dim]``, ``k``/``v`` ``[tokens, kv_heads * head_dim]`` (views of
        the qkv projection's output; unit last stride); per head, RMSNorm with the weights when
        given (both or neither, one ``eps``), then the neox rotary of ``RotaryEmbedding`` over the
        first ``rotary_dim`` dims (float32 ``cos_cache``/``sin_cache`` rows at ``positions``);
        q is rotated in place, K and V are stored at ``loc`` in the pool's ``k_cache``/``v_cache``
        ``[slots, kv_heads, head_dim]`` as ``MHATokenToKVPool.set_kv_buffer`` stores them (float8:
        ``x / scale`` saturated); values rounded as the separate kernels round them;
        ``argmax(logits)``: ``torch.argmax(logits, dim=-1)`` of ``[rows, vocab]`` logits, the same
        ids (the ``Sampler``'s greedy rows). Layers, the pool and the sampler fall back to their
        PyTorch code for names not given. One entry is a flag, not a
        kernel: ``pdl`` (bool), whether layers with Triton kernels of their own (``FusedMoE``) may
        launch them with programmatic dependent launch. Default: none.
        """
        return {}

    def synchronize(self) -> None:
        """Blocks until the current device finished its queued work."""

    def pin_host_memory(self) -> bool:
        """Whether host buffers copied to the device every step should be pinned."""
        return False

    def alloc_pinned_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A large, long-lived host tensor of exactly ``shape`` (uninitialised), page-locked where
        that makes copies to this platform's devices asynchronous (the hierarchical cache's host
        tier). Default: ``torch.empty(..., pin_memory=pin_host_memory())``."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin_host_memory())

    def empty_cache(self) -> None:
        """Returns cached allocator memory to the device."""

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)

    def describe(self) -> str:
        """One line naming the device; the scheduler logs it at start-up (``platform: ...``)."""
        return self.name


# -- the platform of this process, and device helpers for code without one -----------------
_CURRENT: Platform | None = None


class TorchCudaPlatform(Platform):
    """GPUs reached through ``torch.cuda``: NVIDIA on CUDA builds of torch and AMD on ROCm builds
    (HIP answers the same API). One GPU per local rank, ``torch``'s ``nccl`` backend (RCCL on ROCm),
    graph capture, overlapped decode. The cuda and rocm plugins subclass it and add detection,
    dtypes and policies."""

    device_type = "cuda"
    #: the environment variable that narrows the visible GPUs, named in the error for a missing one.
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def device(self, local_rank: int = 0) -> torch.device:
        """``cuda:{local_rank}``: one GPU per local rank (``visible_devices_env`` picks which)."""
        count = torch.cuda.device_count()
        if count and not 0 <= local_rank < count:
            raise ValueError(f"local rank {local_rank} has no GPU: {count} visible (cuda:0..cuda:{count - 1}); "
                             f"lower --tp-size or widen {self.visible_devices_env}")
        return torch.device("cuda", local_rank)

    def set_device(self, device: torch.device) -> None:
        """Makes ``device`` current so kernels and communicators of this process use it."""
        torch.cuda.set_device(device)

    def distributed_backend(self) -> str:
        # PyTorch's ROCm build serves the "nccl" backend name with RCCL.
        return "nccl"

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """(free, total) bytes as the driver reports them (other processes' use included)."""
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)

    def supports_graph_capture(self) -> bool:
        return True

    def supports_overlap_schedule(self) -> bool:
        return True

    def create_stream(self) -> Any:
        return torch.cuda.Stream()

    def stream_context(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def create_event(self) -> Any:
        return torch.cuda.Event()

    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def graph_capture(self, graph: Any, pool: Any, stream: Any) -> Any:
        return torch.cuda.graph(graph, pool=pool, stream=stream)

    def pin_host_memory(self) -> bool:
        return self.is_available()

    def alloc_pinned_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Pages of an ordinary allocation registered with ``cudaHostRegister``: the caching host
        allocator behind ``pin_memory=True`` rounds every block up to a power of two (a 20 GiB
        tier would lock 32 GiB). Falls back to ``pin_memory=True`` when registration fails."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0 or not self.is_available():
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin_host_memory())
        # Faulted in by torch's thread pool first: registering absent pages faults them one by one
        # in the driver (about 2 GB/s on an H200 host).
        flat = torch.empty(nbytes, dtype=torch.uint8)
        flat.fill_(0)
        tensor = flat.view(dtype).view(shape)
        del flat
        try:
            runtime = torch.cuda.cudart()
            registered = int(runtime.cudaHostRegister(tensor.data_ptr(), nbytes, 0)) == 0
        except (AttributeError, RuntimeError):  # a build without the runtime bindings
            registered = False
        if not registered:
            logger.warning("cudaHostRegister of %d bytes failed; pinning with pin_memory=True instead "
                           "(torch's caching host allocator rounds the block up to a power of two)", nbytes)
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        # Unregistered when this tensor object goes (views made from it may outlive it: their
        # pages are then pageable again, still valid, and copies fall back to synchronous ones).
        weakref.finalize(tensor, runtime.cudaHostUnregister, tensor.data_ptr())
        return tensor

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def set_current_platform(platform: Platform | None) -> None:
    """Records the platform this process runs on (the model runner calls it once it is chosen)."""
    global _CURRENT
    _CURRENT = platform


def current_platform() -> Platform | None:
    """The platform set by ``set_current_platform`` (None outside an engine run: kernel tests,
    benchmarks); plugins asking e.g. ``fp8_dtype()`` fall back to their own probe then."""
    return _CURRENT


def _device_module(device_type: str) -> Any:
    """``torch.cuda`` / ``torch.xpu`` / ``torch.npu`` (torch_npu registers it) or None."""
    if device_type == "cpu":
        return None
    try:
        return torch.get_device_module(device_type)
    except (RuntimeError, AttributeError, ValueError):
        return None


def device_index(device: torch.device | None = None, device_type: str = "cuda") -> int:
    """``device``'s index, or for a device without one (a bare ``cuda``) or None the index of the
    current device of its type (``device_type`` for None): what kernel plugins key their
    per-device caches (SM counts, capabilities) on.

    Raises:
        ValueError: for a device type without a device module (``cpu``, ``meta``).
    """
    if device is not None and device.index is not None:
        return int(device.index)
    kind = device.type if device is not None else device_type
    module = _device_module(kind)
    if module is None:
        raise ValueError(f"device_index: device type {kind!r} has no current device; accepted: cuda, xpu, npu "
                         "or a device with an index")
    return int(module.current_device())


def device_type_available(device_type: str) -> bool:
    """Whether torch sees a device of ``device_type`` ("cuda" on a CUDA or ROCm build, "xpu"...)."""
    if device_type == "cpu":
        return True
    module = _device_module(device_type)
    return module is not None and bool(module.is_available())


def device_supports_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 (the CPU does; a GPU older than Ampere does not)."""
    module = _device_module(device.type)
    probe = getattr(module, "is_bf16_supported", None) if module is not None else None
    return True if probe is None else bool(probe())


def _platform_for(device: torch.device) -> Platform | None:
    platform = _CURRENT
    return platform if platform is not None and platform.device_type == device.type else None


def device_event(device: torch.device) -> Any:
    """An event on ``device``'s current stream queue (record/synchronize), or None on the CPU."""
    platform = _platform_for(device)
    if platform is not None:
        return platform.create_event()
    module = _device_module(device.type)
    return module.Event() if module is not None and hasattr(module, "Event") else None


def synchronize_device(device: torch.device) -> None:
    """Waits for ``device``'s queued work (nothing to wait for on the CPU)."""
    module = _device_module(device.type)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize(device)


def pin_host_memory() -> bool:
    """Whether step-by-step host->device buffers should be pinned: the current platform's answer,
    else whether torch sees an accelerator at all."""
    if _CURRENT is not None:
        return _CURRENT.pin_host_memory()
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return False


@contextlib.contextmanager
def using_platform(platform: Platform | None) -> Iterator[None]:
    """Makes ``platform`` current inside the block (tests)."""
    previous = current_platform()
    set_current_platform(platform)
    try:
        yield
    finally:
        set_current_platform(previous)
