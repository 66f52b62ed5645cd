"""CPU checks: registration is import-light, and the planning helpers build FlashInfer's layout."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from engine_attention_flashinfer.options import parse_options
from engine_attention_flashinfer.planning import (
    LayerKey,
    build_paged_kv_layout,
    padding_layout,
    qo_indptr,
    tree_custom_mask,
)

from engine import plugins


def test_importing_the_plugin_does_not_import_flashinfer() -> None:
    code = (
        "import sys, engine_attention_flashinfer\n"
        "from engine import plugins\n"
        "assert 'flashinfer' in plugins.attention_backends()\n"
        "print('flashinfer' in sys.modules, any(m.startswith('flashinfer.') for m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_registration() -> None:
    spec = plugins.get_attention_backend("flashinfer")
    assert spec.factory == "engine_attention_flashinfer.backend:create"
    assert spec.device_types == ("cuda",) and spec.supports_cuda_graph
    options = [o for o in plugins.plugin_options().values() if o.plugin == "flashinfer"]
    assert [(o.key, o.default) for o in options] == [("workspace_mb", 384)]


def test_options() -> None:
    assert parse_options({}) == {"workspace_mb": 384}
    assert parse_options({"workspace_mb": "256"}) == {"workspace_mb": 256}
    with pytest.raises(ValueError, match="accepted: workspace_mb"):
        parse_options({"workspspace_mb": 1})
    with pytest.raises(ValueError, match=">= 16"):
        parse_options({"workspace_mb": 1})


class _Layer:
    def __init__(self, window: int, cap: float, scaling: float = 0.125) -> None:
        self.sliding_window_size, self.logit_cap, self.scaling = window, cap, scaling


def test_layer_key_converts_the_window_convention() -> None:
    # The engine keeps q_pos - k_pos < W; FlashInfer keeps q_pos - k_pos <= window_left.
    assert LayerKey.of(_Layer(16, 30.0)) == LayerKey(15, 30.0, 0.125)
    assert LayerKey.of(_Layer(-1, 0.0)) == LayerKey(-1, 0.0, 0.125)
    assert LayerKey.of(_Layer(-1, 0.0)) != LayerKey.of(_Layer(-1, 0.0, 0.1))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_layout_matches_a_host_loop(page_size: int) -> None:
    from engine.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

    torch.manual_seed(page_size)
    r2t = ReqToTokenPool(8, 256, "cpu")
    alloc = TokenToKVPoolAllocator(4096, page_size, "cpu")
    alloc.free_pages = alloc.free_pages[torch.randperm(len(alloc.free_pages))]
    slots = r2t.alloc(5)
    lens = [1, 17, 64, 3, 100]
    for s, n in zip(slots, lens, strict=True):
        r2t.write(s, 0, alloc.alloc_extend([0], [n], [-1]))
    order = [3, 0, 4, 1]  # a batch need not follow slot order
    batch_slots, batch_lens = [slots[i] for i in order], [lens[i] for i in order]
    layout = build_paged_kv_layout(r2t.req_to_token, torch.tensor(batch_slots), torch.tensor(batch_lens),
                                   batch_lens, page_size)
    want_indices, want_indptr, want_last = [], [0], []
    for s, n in zip(batch_slots, batch_lens, strict=True):
        pages = [int(r2t.req_to_token[s, p]) // page_size for p in range(0, n, page_size)]
        want_indices += pages
        want_indptr.append(want_indptr[-1] + len(pages))
        want_last.append(n - (len(pages) - 1) * page_size)
    assert layout.kv_indices.dtype == torch.int32 and layout.kv_indptr_cpu.dtype == torch.int32
    assert layout.kv_indices.tolist() == want_indices
    assert layout.kv_indptr_cpu.tolist() == want_indptr
    assert layout.kv_last_page_len_cpu.tolist() == want_last
    assert layout.batch_size == len(order)


def test_small_host_helpers() -> None:
    assert qo_indptr([3, 1, 1]).tolist() == [0, 3, 4, 5]
    one = padding_layout(2, 1, torch.device("cpu"))
    assert one.kv_indices.tolist() == [0, 0] and one.kv_last_page_len_cpu.tolist() == [1]
    paged = padding_layout(2, 16, torch.device("cpu"))
    assert paged.kv_indices.tolist() == [0] and paged.kv_last_page_len_cpu.tolist() == [2]



def test_unsupported_head_dim_is_refused_with_the_accepted_sizes() -> None:
    from engine_attention_flashinfer.planning import check_head_dim

    for ok in (64, 128, 256):
        check_head_dim(ok)
    with pytest.raises(ValueError, match="head_dim 16 is not supported; accepted: 64, 128, 256"):
        check_head_dim(16)


def test_float32_is_refused_with_the_accepted_dtypes() -> None:
    import torch

    from engine_attention_flashinfer.planning import check_dtype

    check_dtype(torch.bfloat16)
    check_dtype(torch.float16)
    with pytest.raises(ValueError, match="dtype float32 is not supported; accepted: float16, bfloat16"):
        check_dtype(torch.float32)


def test_tree_custom_mask_covers_prefix_and_ancestors() -> None:
    """FlashInfer's per-row [new tokens x whole sequence] mask from the engine's tree mask:
    the prefix visible to every new token, then the row's ancestor matrix."""
    from engine.speculative.tree import tree_mask_of_rows

    parents = [[-1, 0, 0, 1], [-1], [-1, 0]]
    prefix = [3, 0, 2]
    tree, _ = tree_mask_of_rows(parents, "cpu")
    got = tree_custom_mask(tree, [4, 1, 2], prefix)
    row0 = [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 0, 1]]
    want = [b for r in row0 for b in r] + [1] + [1, 1, 1, 0, 1, 1, 1, 1]
    assert got.tolist() == [bool(b) for b in want]
