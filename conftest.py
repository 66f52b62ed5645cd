"""Workspace-wide pytest set-up, loaded before any test module.

Without a CUDA device, Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
numpy on the CPU), so the kernels of the quant and attention plugins are tested for correctness
here and in CI too; their speed is measured on a GPU only. Triton reads the variable when a
kernel is decorated, so it is set here, before any kernel module is imported.
"""

from __future__ import annotations

import gc
import os
import sys

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


# Modules that take the longest on a CPU-only machine, slowest group first (per-test durations
# summed by group, from a pytest --report-log of the suite on two workers: a shared server's
# group is ranked by its first module here; modules added since that log are placed by a later
# log of a busier moment, its durations scaled by the ratio of the two logs' common modules). Under pytest-xdist they are handed out first,
# longest first, so the long ones run side by side at the start and the short ones even out the
# end, not one long module alone at the end. Only the order changes: a module missing here runs
# all the same, after these.
SLOW_MODULES: tuple[str, ...] = (
    "tests/test_docs_examples.py",
    "core/tests/distributed/test_parallel_parity.py",
    "tests/test_server_e2e_dp.py",
    "tests/test_server_e2e_tools.py",
    "tests/test_third_party_plugin.py",
    "plugins-quant/gguf/tests/test_gguf_kernels.py",
    "tests/test_server_e2e_availability.py",
    "plugins/platform-cuda/tests/test_gemv_norm.py",
    "plugins/lora-triton/tests/test_sgmv_interpreter.py",
    "tests/test_server_e2e_parallel.py",
    "plugins/platform-cuda/tests/test_argmax.py",
    "plugins-attention/triton/tests/test_triton_interpreter.py",
    "plugins-quant/int8/tests/test_int8_kernels.py",
    "plugins-models/deepseek/tests/test_deepseek_models.py",
    "plugins/platform-cuda/tests/test_gemv_kernel.py",
    "tests/test_server_e2e_responses.py",
    "tests/test_quant_across_attention_backends.py",
    "core/tests/layers/moe/test_moe_small_batch.py",
    "plugins-quant/fp8/tests/test_fp8_kernels.py",
    "plugins-quant/wna16/tests/test_kernels.py",
    "core/tests/layers/moe/test_align_kernel.py",
    "plugins/platform-cuda/tests/test_qkv_prologue.py",
    "core/tests/distributed/test_parallel_grammar.py",
    "core/tests/layers/moe/test_router_kernel.py",
    "core/tests/model_executor/test_kv_cache_fp8.py",
    "core/tests/speculative/test_scheduler_tree.py",
    "tests/test_disaggregation_e2e.py",
    "plugins/platform-cuda/tests/test_qkv_prologue_layer.py",
    "tests/test_server_e2e_scoring.py",
    "core/tests/layers/moe/test_moe_kernel.py",
    "core/tests/test_cli.py",
    "core/tests/entrypoints/test_child_process.py",
    "core/tests/model_executor/test_gguf.py",
    "tests/test_server_e2e_parallel_pp.py",
    "core/tests/entrypoints/test_engine.py",
    "core/tests/bench/test_bench_multi_turn.py",
    "core/tests/test_cli_imports.py",
    "plugins-models/moe/tests/test_moe_expert_parallel.py",
    "plugins/spec-eagle/tests/test_eagle.py",
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


def _speed_up_triton_interpreter() -> None:
    """Two lookups of Triton's interpreter (``triton.runtime.interpreter``) answered from a table.

    Every kernel launch under the interpreter patches triton.language's builtins for its duration,
    finding them with ``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math`` and more, and
    converting a Triton dtype to numpy's (``_get_np_dtype``) builds a dict of every dtype on each
    call: together ~20% of a kernel-test module's CPU. Here the names of each package's builtins
    are found once (each launch still patches what those names hold, and only builtins), and a
    dtype's numpy dtype is kept once converted; what the kernels compute is unchanged.
    """
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is None or getattr(interpreter, "_suite_tables", False):
        return
    patch_builtin, patch_attr = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_patch_attr", None)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if patch_builtin is None or patch_attr is None or np_dtype is None:
        interpreter._suite_tables = True  # looked at: warned once, not at every test's set-up
        import warnings

        warnings.warn("conftest: triton.runtime.interpreter has no _patch_builtin, _patch_attr or _get_np_dtype "
                      "(another Triton version?): its lookups are not answered from tables, so kernel tests under "
                      "the interpreter run ~20% slower", stacklevel=1)
        return
    import inspect

    tl = interpreter.tl
    builtin_names: dict[object, tuple[str, ...]] = {}

    def patch_builtins(pkg: object, builder: object, scope: object) -> None:
        names = builtin_names.get(pkg)
        if names is None:  # the first launch finds them before it patches anything of pkg
            names = builtin_names[pkg] = tuple(name for name, member in inspect.getmembers(pkg)
                                               if tl.core.is_builtin(member))
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    converted: dict[object, object] = {}

    def get_np_dtype(tt_dtype: object) -> object:
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty  # a block converts as its element type does
        if isinstance(tt_dtype, tl.pointer_type):
            return np_dtype(tt_dtype)
        try:
            found = converted.get(tt_dtype)
        except TypeError:  # unhashable
            return np_dtype(tt_dtype)
        if found is None:
            found = converted[tt_dtype] = np_dtype(tt_dtype)
        return found

    interpreter._patch_builtin = patch_builtins
    interpreter._get_np_dtype = get_np_dtype
    interpreter._suite_tables = True
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # a GPU's compiles keep Triton's own
        _speed_up_triton_types(tl.core)


def _speed_up_triton_types(core: object) -> None:
    """Two constructors of triton.language's types that every interpreted operation calls, kept from
    redoing what depends only on a shape of plain ints.

    Each op builds a ``block_type`` (most do) and a ``tensor``; both hold their shape as a
    ``tl.tuple`` (of ints, of constexprs) whose ``tuple_type`` makes an element type per dimension and
    formats its name from them, and the block type also unwraps its shape as if it held constexprs
    and checks it again: a fifth of the CPU of the suite's interpreted kernel modules. Here a shape
    of ints takes its checked numel, its tuple's element types and names from a table; every object
    is still a new one with the same fields, and any other shape takes Triton's own path. Installed
    only where the objects built both ways are equal, field for field.
    """
    block_type, tensor, tuple_type, constexpr, tl_tuple = (core.block_type, core.tensor, core.tuple_type,
                                                           core.constexpr, core.tuple)
    block_init, tensor_init = block_type.__init__, tensor.__init__
    # shape -> its numel (checked), its tuple's element types and name, and the tuple's str
    known: dict[tuple[int, ...], tuple[int, list[object], str, str]] = {}

    def shape_tuple(values: list[object], entry: tuple[int, list[object], str, str]) -> object:
        typed = tuple_type.__new__(tuple_type)
        typed.types, typed.fields, typed.name = list(entry[1]), [""] * len(values), entry[2]
        return tl_tuple(values, typed)

    def fast_block_init(self: object, element_ty: object, shape: object) -> None:
        # A list or a tl.tuple of ints (Triton's ops pass both); constexprs take its own path.
        dims = shape if type(shape) is list else shape.values if type(shape) is tl_tuple else None
        if not dims or any(type(d) is not int for d in dims):
            return block_init(self, element_ty, shape)
        entry = known.get(tuple(dims))
        if entry is None:
            return block_init(self, element_ty, shape)  # checks it (raising where Triton does)
        self.element_ty, self.shape, self.numel = element_ty, shape_tuple(list(dims), entry), entry[0]
        self.name = f"<{entry[3]}, {element_ty}>"

    def fast_tensor_init(self: object, handle: object, ty: object) -> None:
        if not ty.is_block():
            key: tuple[int, ...] | None = ()  # a scalar: an empty shape
        else:
            dims = ty.shape.values if type(ty.shape) is tl_tuple else None
            key = tuple(dims) if dims and all(type(d) is int for d in dims) else None
        entry = known.get(key) if key is not None else None
        if entry is None:
            tensor_init(self, handle, ty)
            if key is not None and self.type is ty:  # learnt from what Triton built (and checked)
                made = ty.shape if key else self.shape
                known[key] = (self.numel.value, list(made.type.types), made.type.name, str(made))
            return
        self.handle, self.type, self.dtype = handle, ty, ty.scalar
        self.numel = constexpr(entry[0])
        self.shape = shape_tuple([constexpr(d) for d in key], entry)

    # The check: block types (from a list, from another's tl.tuple shape), a tensor of one and a
    # scalar, built by Triton, then both ways from the table.
    def built(make_block: object, make_tensor: object) -> tuple[object, ...]:
        block, twin = block_type.__new__(block_type), block_type.__new__(block_type)
        value, scalar = tensor.__new__(tensor), tensor.__new__(tensor)
        make_block(block, core.int32, [4, 8])
        make_block(twin, core.float16, block.shape)
        make_tensor(value, None, block)
        make_tensor(scalar, None, core.int32)
        return block, twin, value, scalar

    def fields(block: object, twin: object, value: object, scalar: object) -> tuple[object, ...]:
        kinds = tuple((vars(b).keys(), b.element_ty, b.shape.values, b.numel, b.name, b.shape.type.name,
                       [str(t) for t in b.shape.type.types]) for b in (block, twin))
        values = tuple((vars(v).keys(), v.type, str(v.shape), v.shape.type.name, v.numel.value, v.dtype)
                       for v in (value, scalar))
        return kinds + values

    want = fields(*built(block_init, tensor_init))
    for _ in range(2):  # the first time learns the shape, the second takes it from the table
        if fields(*built(fast_block_init, fast_tensor_init)) != want:
            known.clear()
            import warnings

            warnings.warn("conftest: triton.language's block_type or tensor differs from what the suite's tables "
                          "build (another Triton version?): kept as Triton has them", stacklevel=1)
            return
    block_type.__init__ = fast_block_init
    tensor.__init__ = fast_tensor_init


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Kernel modules decorate their kernels at import, which imports Triton's interpreter (with
    TRITON_INTERPRET=1): by a test's set-up it is in where the test launches a kernel (this
    costs a dict lookup where it is not, or is set up already)."""
    _speed_up_triton_interpreter()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run is over: what it built is frozen, so neither the collections of pytest's own
    shutdown nor the interpreter's last one walk it again (1.0-1.2 -> 0.12 s from here to exit for
    a small kernel-test run; an xdist worker at the end of the suite holds far more). Cleanups
    (the shared servers' stop) and atexit handlers still run. No test runs pytest in-process."""
    gc.freeze()
