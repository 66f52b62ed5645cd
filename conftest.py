"""Workspace-wide pytest set-up, loaded before any test module.

Without a CUDA device, Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
numpy on the CPU), so the kernels of the quant and attention plugins are tested for correctness
here and in CI too; their speed is measured on a GPU only. Triton reads the variable when a
kernel is decorated, so it is set here, before any kernel module is imported.
"""

from __future__ import annotations

import gc
import os

import pytest

# Young garbage collected every 10,000 allocations instead of 700, as in the engine's own processes
# (engine.entrypoints.child_process.GC_GEN0_THRESHOLD): a test process holds torch, transformers
# and models, and Triton's interpreter allocates fast, so at 700 the collector keeps walking that
# heap: 4-7% of a kernel-test module's CPU (gguf kernels 19.4 -> 18.0 s, qkv prologue 17.2 -> 16.4).
gc.set_threshold(10_000, *gc.get_threshold()[1:])


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if "TRITON_INTERPRET" not in os.environ and not _has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"


# Modules that take the longest on a CPU-only machine (per-test durations summed by module, from
# a pytest --report-log of the suite on two workers), slowest first. Under pytest-xdist they are
# handed out first, so the long ones run side by side at the start, not one alone at the end.
# Only the order changes: a module missing here runs all the same, after these.
SLOW_MODULES: tuple[str, ...] = (
    "tests/test_docs_examples.py",
    "tests/test_default_model.py",
    "tests/test_dashboard_browser.py",
    "tests/test_disaggregation_e2e.py",
    "core/tests/layers/moe/test_align_kernel.py",
    "tests/test_server_e2e_tools.py",
    "tests/test_server_e2e_lora.py",
    "tests/test_server_e2e_responses.py",
    "tests/test_structured_output_e2e.py",
    "tests/test_server_e2e_embeddings.py",
    "tests/test_server_e2e_scoring.py",
    "tests/test_server_e2e_parallel.py",
    "tests/test_server_e2e_availability.py",
    "tests/test_server_e2e_lifecycle.py",
    "tests/test_server_e2e_grpc.py",
    "core/tests/distributed/test_parallel_parity.py",
    "core/tests/distributed/test_parallel_grammar.py",
    "tests/test_server_e2e_dp.py",
    "core/tests/speculative/test_scheduler_tree.py",
    "tests/test_server_e2e_parallel_pp.py",
    "plugins/lang/tests/test_runtime_endpoint.py",
    "tests/test_server_e2e.py",
    "core/tests/layers/moe/test_moe_small_batch.py",
    "plugins/lang/tests/test_openai_backend.py",
    "plugins/platform-cuda/tests/test_qkv_prologue.py",
    "plugins/platform-cuda/tests/test_gemv_kernel.py",
    "core/tests/entrypoints/test_engine.py",
    "tests/test_default_model_spec.py",
    "core/tests/entrypoints/test_child_process.py",
    "plugins/lang/tests/test_engine_backend.py",
    "tests/test_bench_cli_e2e.py",
    "plugins/platform-cuda/tests/test_qkv_prologue_layer.py",
    "plugins/platform-cuda/tests/test_gemv_norm.py",
    "tests/test_quant_across_attention_backends.py",
    "plugins-quant/compressed-tensors/tests/test_ct_end_to_end.py",
    "plugins-quant/awq/tests/test_awq_end_to_end.py",
)


# The session's shared servers (tests/test_server_e2e_harness.py) start once per pytest process, so
# under xdist once per worker that uses them. The modules that call one (or whose conftest.py does)
# form one group, which one worker runs: each server starts once in the suite, not once a worker
# (a default-model start costs ~16 s of CPU, a tiny-checkpoint one ~10).
SHARED_SERVER_GROUPS: tuple[tuple[str, str], ...] = (
    ("shared_default_server(", "shared-default-model-server"),
    ("shared_server(", "shared-tiny-checkpoint-server"),
)
_shared_group_cache: dict[str, str | None] = {}


def _shared_server_group(path: str) -> str | None:
    """The shared-server group of the test module at ``path`` (None: it starts no shared server)."""
    if path not in _shared_group_cache:
        texts = []
        for source in (path, os.path.join(os.path.dirname(path), "conftest.py")):
            try:
                with open(source, encoding="utf-8") as f:
                    texts.append(f.read())
            except OSError:
                pass
        found = [group for call, group in SHARED_SERVER_GROUPS if any(call in text for text in texts)]
        _shared_group_cache[path] = found[0] if found else None
    return _shared_group_cache[path]


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _group_of(item: pytest.Item) -> str:
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return _shared_server_group(str(item.path)) or _module_of(item)
    return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which writes the groups into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` (scripts/test.sh): each module not in an explicit group forms
    its own, so a module runs on one worker and its module- and session-scoped fixtures (servers,
    checkpoints, compiled kernels) are set up once; the modules of a shared server form one group
    (SHARED_SERVER_GROUPS); the groups of SLOW_MODULES come first."""
    # On an xdist worker (where collection happens) xdist sets `loadgroup` and resets `dist`.
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_shared_server_group(str(item.path)) or _module_of(item)))
    rank: dict[str, int] = {}
    for item in items:
        if _module_of(item) in SLOW_MODULES:
            group = _group_of(item)
            rank[group] = min(rank.get(group, len(SLOW_MODULES)), SLOW_MODULES.index(_module_of(item)))
    # sort is stable: within a group, and for every group not ranked, collection order stays.
    items.sort(key=lambda item: rank.get(_group_of(item), len(SLOW_MODULES)))


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run is over: what it built is frozen, so neither the collections of pytest's own
    shutdown nor the interpreter's last one walk it again (1.0-1.2 -> 0.12 s from here to exit for
    a small kernel-test run; an xdist worker at the end of the suite holds far more). Cleanups
    (the shared servers' stop) and atexit handlers still run. No test runs pytest in-process."""
    gc.freeze()
