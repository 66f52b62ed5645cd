"""``check_lora_backend`` / ``LoraBackendConformance``: a LoRA backend's shrink and expand agree
with the plain torch loop of ``engine.lora.backend`` on random segmented batches (empty segments,
rank-0 slots, ranks 8 and 16, one to three slices, float32 and bfloat16 where the device has it),
and so does its optional ``apply`` (shrink then expand in one call), on those batches and on a
decode batch of one-token segments, and its optional ``fold_expand`` (the expand of a shrink folded
into the base GEMM), on those batches with padding rows after the last segment."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from engine.lora.backend import (
    LoraBackend,
    LoraBatchInfo,
    reference_expand,
    reference_fold_expand,
    reference_shrink,
)
from engine.platforms import device_supports_bf16
from engine.testing.conformance._common import (
    KIT_SEED,
    derive_seed,
    device_or_skip,
    generator,
    randn,
)

#: (n_slices, output columns of each slice) the kit draws: o/down, gate_up, qkv with GQA.
SLICE_SHAPES = ((1, (48,)), (2, (40, 40)), (3, (32, 16, 16)))
#: max rank of the pool, and the ranks its slots hold (0: an empty slot).
POOL_RANK = 16
SLOT_RANKS = (0, 8, 16, 8)
#: tolerances by dtype: (atol, rtol) relative to the output's scale.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


def _backend(spec_or_backend: Any) -> LoraBackend:
    if isinstance(spec_or_backend, str):
        from engine import plugins

        spec_or_backend = plugins.get_lora_backend(spec_or_backend)
    if hasattr(spec_or_backend, "factory"):
        from engine import plugins

        return plugins.create(spec_or_backend.factory, options=plugins.declared_options("lora-backend", spec_or_backend.name))
    return spec_or_backend


def random_batch_info(gen: torch.Generator, seg_lens: list[int], slots: list[int], device: torch.device,
                      slot_ranks: tuple[int, ...] = SLOT_RANKS) -> LoraBatchInfo:
    """A ``LoraBatchInfo`` for segments of ``seg_lens`` tokens on ``slots``, with random scalings."""
    indptr = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(seg_lens, dtype=torch.int32), 0)
    return LoraBatchInfo(
        num_segments=len(seg_lens), seg_indptr=indptr.to(device),
        weight_indices=torch.tensor(slots, dtype=torch.int32, device=device),
        lora_ranks=torch.tensor(slot_ranks, dtype=torch.int32, device=device),
        scalings=(torch.rand(len(slot_ranks), generator=gen) * 2 + 0.25).to(device),
        max_seg_len=max(seg_lens, default=0))


def random_pool_weights(gen: torch.Generator, n_slices: int, k: int, n_total: int, device: torch.device,
                        dtype: torch.dtype, slot_ranks: tuple[int, ...] = SLOT_RANKS,
                        rank: int = POOL_RANK) -> tuple[torch.Tensor, torch.Tensor]:
    """A [slots, n_slices * rank, k] and B [slots, n_total, rank] as the pool holds them: rows and
    columns beyond a slot's rank are zero, and a rank-0 slot holds stale non-zero values (an
    evicted adapter's), which a backend must ignore."""
    a = torch.randn(len(slot_ranks), n_slices * rank, k, generator=gen) / k ** 0.5
    b = torch.randn(len(slot_ranks), n_total, rank, generator=gen) / rank ** 0.5
    for slot, r in enumerate(slot_ranks):
        if r == 0:
            continue
        for i in range(n_slices):
            a[slot, i * rank + r:(i + 1) * rank] = 0
        b[slot, :, r:] = 0
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


def _segments(gen: torch.Generator, num_slots: int) -> tuple[list[int], list[int]]:
    """Segment lengths with empty ones, a long one and single tokens, on random slots."""
    lens = [int(v) for v in torch.randint(0, 9, (7,), generator=gen)] + [0, 1, 37, 1, 0]
    order = torch.randperm(len(lens), generator=gen).tolist()
    lens = [lens[i] for i in order]
    slots = [int(v) for v in torch.randint(0, num_slots, (len(lens),), generator=gen)]
    return lens, slots


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOLERANCES[dtype]
    scale = max(float(want.float().abs().max()), 1.0)
    err = float((got.float() - want.float()).abs().max()) if want.numel() else 0.0
    assert err <= atol * scale + rtol * scale, f"{what}: max abs error {err:.3g} over the reference (scale {scale:.3g}, dtype {dtype})"


def dtypes_for(device: torch.device) -> list[torch.dtype]:
    """float32 everywhere; bfloat16 where the device computes it (CPU does, slowly but exactly enough)."""
    if not device_supports_bf16(device):
        return [torch.float32, torch.float16]
    return [torch.float32, torch.bfloat16]


def check_lora_backend(spec_or_backend: Any, device: str | torch.device = "cpu", seed: int = KIT_SEED) -> None:
    """Checks ``shrink`` and ``expand`` of a backend (a ``LoraBackendSpec``, a registered name or
    an instance) against the torch reference; raises AssertionError naming the case that differs."""
    dev = torch.device(device)
    backend = _backend(spec_or_backend)
    assert isinstance(backend, LoraBackend), f"{type(backend).__name__} lacks name/shrink/expand of LoraBackend"
    k = 64
    for dtype in dtypes_for(dev):
        for n_slices, widths in SLICE_SHAPES:
            case = f"{backend.name}: dtype {dtype}, n_slices {n_slices}"
            gen = generator(derive_seed(seed, dtype, n_slices))
            lens, slots = _segments(gen, len(SLOT_RANKS))
            info = random_batch_info(gen, lens, slots, dev)
            tokens = sum(lens)
            n_total = sum(widths)
            offsets = [0]
            for w in widths:
                offsets.append(offsets[-1] + w)
            a, b = random_pool_weights(gen, n_slices, k, n_total, dev, dtype)
            x = randn(gen, tokens, k, device=dev, dtype=dtype)
            y = backend.shrink(x, a, info)
            assert y.shape == (tokens, n_slices * POOL_RANK), f"{case}: shrink returned shape {tuple(y.shape)}"
            assert y.dtype == dtype, f"{case}: shrink returned {y.dtype}, not x's {dtype}"
            assert y.device.type == dev.type, f"{case}: shrink returned a tensor on {y.device}"
            _close(y, reference_shrink(x, a, info), dtype, f"{case}: shrink")
            base = randn(gen, tokens, n_total, device=dev, dtype=dtype)
            out = base.clone()
            want = base.clone()
            y_in = y.clone()  # the reference reads the backend's own y: expand is checked alone
            backend.expand(y_in, b, info, out, offsets)
            reference_expand(y, b, info, want, offsets)
            _close(out, want, dtype, f"{case}: expand")
            untouched = _rank0_rows(info)
            if untouched.any():
                assert torch.equal(out[untouched], base[untouched]), f"{case}: expand changed rows of rank-0 segments"
            if callable(getattr(backend, "apply", None)):
                _check_apply(backend, gen, info, a, b, offsets, dev, dtype, case)
                # A decode batch: one-token segments (and two empty ones), enough of them for the
                # forms a backend keeps for many requests.
                decode_lens = [1] * 18 + [0, 0]
                decode_slots = [int(v) for v in torch.randint(0, len(SLOT_RANKS), (20,), generator=gen)]
                decode = random_batch_info(gen, decode_lens, decode_slots, dev)
                _check_apply(backend, gen, decode, a, b, offsets, dev, dtype, f"{case}, decode batch")
            if callable(getattr(backend, "fold_expand", None)):
                decode = random_batch_info(gen, [1] * 18 + [0, 0], [int(v) for v in torch.randint(
                    0, len(SLOT_RANKS), (20,), generator=gen)], dev)
                for batch, what in ((info, ""), (decode, ", decode batch")):
                    _check_fold(backend, gen, batch, b, offsets, dev, dtype, f"{case}{what}")


def _check_fold(backend: Any, gen: torch.Generator, info: LoraBatchInfo, b: torch.Tensor, offsets: list[int],
                dev: torch.device, dtype: torch.dtype, case: str) -> None:
    """A backend's optional ``fold_expand`` equals the reference on ``h`` with two padding rows;
    rows of rank-0 segments and padding rows are ``h``'s base columns."""
    tokens = int(info.seg_indptr[-1]) + 2
    n = offsets[-1]
    h = randn(gen, tokens, n + b.shape[0] * (len(offsets) - 1) * b.shape[2], device=dev, dtype=dtype)
    got = backend.fold_expand(h, b, info, offsets)
    assert tuple(got.shape) == (tokens, n) and got.dtype == dtype, \
        f"{case}: fold_expand returned {tuple(got.shape)} {got.dtype}, not ({tokens}, {n}) {dtype}"
    assert got.is_contiguous(), f"{case}: fold_expand returned a non-contiguous tensor"
    _close(got, reference_fold_expand(h, b, info, offsets), dtype, f"{case}: fold_expand")
    keep = torch.ones(tokens, dtype=torch.bool, device=dev)
    keep[:tokens - 2] = _rank0_rows(info)
    assert torch.equal(got[keep], h[keep, :n]), f"{case}: fold_expand changed rows of rank-0 segments or padding"


def _check_apply(backend: Any, gen: torch.Generator, info: LoraBatchInfo, a: torch.Tensor, b: torch.Tensor,
                 offsets: list[int], dev: torch.device, dtype: torch.dtype, case: str) -> None:
    """A backend's optional ``apply`` equals the reference shrink then expand."""
    tokens = int(info.seg_indptr[-1])
    x = randn(gen, tokens, a.shape[2], device=dev, dtype=dtype)
    base = randn(gen, tokens, offsets[-1], device=dev, dtype=dtype)
    out, want = base.clone(), base.clone()
    backend.apply(x, a, b, info, out, offsets)
    reference_expand(reference_shrink(x, a, info), b, info, want, offsets)
    _close(out, want, dtype, f"{case}: apply")
    untouched = _rank0_rows(info)
    if untouched.any():
        assert torch.equal(out[untouched], base[untouched]), f"{case}: apply changed rows of rank-0 segments"


def _rank0_rows(info: LoraBatchInfo) -> torch.Tensor:
    bounds = info.seg_indptr.tolist()
    mask = torch.zeros(bounds[-1], dtype=torch.bool, device=info.seg_indptr.device)
    for seg, slot in enumerate(info.weight_indices.tolist()):
        if int(info.lora_ranks[slot]) == 0:
            mask[bounds[seg]:bounds[seg + 1]] = True
    return mask


def make_peft_adapter(base: str, out: str, r: int, targets: list[str] | tuple[str, ...], seed: int,
                      alpha: float | None = None, use_rslora: bool = False) -> str:
    """A random PEFT LoRA adapter of the checkpoint ``base`` (``lora_alpha`` 2r unless given),
    written to ``out`` with ``save_pretrained``. ``init_lora_weights=False`` draws B at random too
    (PEFT's default zero B would leave the model unchanged). Needs ``peft``."""
    from peft import LoraConfig, get_peft_model

    from engine.testing.checkpoints import load_hf_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, target_modules=list(targets),
                        init_lora_weights=False, use_rslora=use_rslora)
    get_peft_model(load_hf_model(base), config).save_pretrained(out)
    return out


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]], max_new_tokens: int,
                merged: bool = False) -> list[list[int]]:
    """Greedy output ids of PEFT's ``PeftModel`` (or its ``merge_and_unload()``) in float32, the
    oracle of LoRA parity tests; the base model alone when ``adapter`` is None."""
    from peft import PeftModel

    from engine.testing.checkpoints import hf_greedy, load_hf_model

    model = load_hf_model(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
        if merged:
            model = model.merge_and_unload().eval()
    return [hf_greedy(model, p, max_new_tokens) for p in prompts]


class LoraBackendConformance:
    """Set ``backend_name`` (and ``device``, default cpu). ``test_matches_reference`` runs
    ``check_lora_backend``; ``test_spec`` checks the registration."""

    backend_name: ClassVar[str] = ""
    device: ClassVar[str] = "cpu"
    seed: ClassVar[int] = KIT_SEED

    def test_spec(self) -> None:
        from engine import plugins

        spec = plugins.get_lora_backend(self.backend_name)
        assert spec.name == self.backend_name
        assert torch.device(self.device).type in spec.device_types, (
            f"'{self.backend_name}' does not list device type {torch.device(self.device).type} in device_types")

    def test_matches_reference(self) -> None:
        from engine import plugins

        check_lora_backend(plugins.get_lora_backend(self.backend_name), device_or_skip(self.device), self.seed)

    def test_empty_batch(self) -> None:
        """A forward with no tokens (a pipeline stage's idle step) must not fail."""
        from engine import plugins

        dev = device_or_skip(self.device)
        backend = _backend(plugins.get_lora_backend(self.backend_name))
        gen = generator(self.seed)
        info = random_batch_info(gen, [0], [1], dev)
        a, b = random_pool_weights(gen, 1, 32, 24, dev, torch.float32)
        y = backend.shrink(torch.zeros(0, 32, device=dev), a, info)
        assert tuple(y.shape) == (0, POOL_RANK)
        backend.expand(y, b, info, torch.zeros(0, 24, device=dev), [0, 24])


__all__ = ["LoraBackendConformance", "check_lora_backend", "make_peft_adapter", "peft_greedy", "random_batch_info",
           "random_pool_weights"]
