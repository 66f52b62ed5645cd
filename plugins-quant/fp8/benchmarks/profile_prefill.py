"""GPU time of one prefill chunk by kernel class, the GEMMs by projection (needs a CUDA GPU for the
kernel table; on the CPU it runs the same steps and prints the aten ops' CPU time).

    python plugins-quant/fp8/benchmarks/profile_prefill.py docs/bench_configs/llama-3-8b --quant fp8 \\
        --extra '{"kv_cache_dtype": "fp8_e4m3"}' --chunks 8192,16384

Each chunk is ``chunk / --input-len`` whole prompts of ``--input-len`` random tokens with no cached
prefix, prefilled in one forward (``--chunked-prefill-size`` is raised to the largest chunk), as
``engine bench offline`` prefills 1,024-token prompts eight at a time at the default 8,192. CUDA
graphs are off (a prefill runs eagerly anyway). Per chunk: the unprofiled wall time of the forward
and its sampling (median of ``--reps``), the sum of its kernel times, then milliseconds by class and
the GEMMs by projection (from the shapes of the aten op that launched each GEMM kernel).

``--variant LABEL:module.ATTR=VALUE`` profiles each chunk again with module switches set (a
before/after in one process, one model load), ``quant_config.ATTR`` sets it on the model's quantization
config, e.g. ``--no-fast-accum``: ``fast_accum=False`` (the fp8 plugin option, on by default: off, the
fp8 GEMMs promote their partial sums to float32).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from typing import Any

import torch

# Kernel name fragments -> class, first match wins (lower case).
CLASSES = (
    ("activation quantization", ("_quantize_per_token",)),
    ("rmsnorm (+quant)", ("rmsnorm", "rms_norm")),
    ("silu-mul (+quant)", ("silu",)),
    ("rope + kv write", ("prologue", "rotary", "rope", "store_kv", "set_kv")),
    ("kv widening", ("widen",)),
    ("attention", ("extend", "attn", "attention", "flash", "prefill")),
    ("gemm", ("nvjet", "gemm", "gemv", "cutlass", "sm90_xmma", "splitk", "_w8a8", "_dot_kernel")),
    ("copies, gathers", ("copy", "gather", "memset", "memcpy", "cat", "index", "elementwise", "fill")),
)


def classify(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def projections(config_dir: str) -> tuple[dict[tuple[int, int], str], int]:
    """(N, K) of each linear of a Llama-style layer -> its name, and the layer count, from the
    model's config.json."""
    with open(f"{config_dir}/config.json") as f:
        cfg = json.load(f)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads", heads), cfg.get("head_dim", h // heads)
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    return {((heads + 2 * kv) * hd, h): "qkv_proj", (h, heads * hd): "o_proj",
            (2 * inter, h): "gate_up_proj", (h, inter): "down_proj", (vocab, h): "lm_head"}, cfg["num_hidden_layers"]


def gemm_split(prof: Any, names: dict[tuple[int, int], str]) -> dict[str, float]:
    """Microseconds of GEMM kernels by projection: each aten GEMM op's kernels, named by its
    weight operand's shape (``[K, N]`` as ``weight.t()`` or ``[N, K]`` for ``F.linear``)."""
    out: dict[str, float] = collections.defaultdict(float)
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CPU or not evt.kernels:
            continue
        if evt.name not in ("aten::_scaled_mm", "aten::mm", "aten::addmm", "aten::matmul", "aten::linear"):
            continue
        shapes = [s for s in evt.input_shapes if isinstance(s, list) and len(s) == 2]
        label = evt.name
        if len(shapes) >= 2:
            k, n = shapes[1]
            label = names.get((n, k)) or names.get((k, n)) or f"{evt.name} {shapes[0]}x{shapes[1]}"
            if len(shapes[0]) == 2 and names.get((n, k)) is None and names.get((k, n)) is None:
                label = f"{evt.name} M={shapes[0][0]} {shapes[1]}"
        for kern in evt.kernels:
            out[label] += kern.duration
    return out


def profile_chunk(sched: Any, tokens: int, input_len: int, reps: int, on_gpu: bool,
                  names: dict[tuple[int, int], str], layers: int, tag: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from engine.bench.kernel_times import kernel_times, print_by_class
    from engine.bench.one_batch import run_one

    rows = max(1, tokens // input_len)
    walls = [run_one(sched, rows, input_len, 1, overlap=False, seed=r).prefill_latency_s for r in range(reps + 1)]
    wall = statistics.median(walls[1:])  # the first may compile
    # CPU activity too: the aten ops that launched the GEMM kernels carry the weight shapes.
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities, record_shapes=True) as prof:
        run_one(sched, rows, input_len, 1, overlap=False, seed=reps + 1)
    times = kernel_times(prof, on_gpu)
    total = sum(times.values())
    n = rows * input_len
    print(f"== {tag}: chunk of {rows} x {input_len} = {n} tokens: wall {wall * 1e3:.2f} ms "
          f"({n / wall:,.0f} tok/s; reps {', '.join(f'{w * 1e3:.1f}' for w in walls)}), kernels "
          f"{total / 1e3:.2f} ms ({n / max(total, 1e-9) * 1e6:,.0f} tok/s of kernel time)", flush=True)
    print_by_class(times, classify, total, label_width=26)
    if on_gpu:
        split = gemm_split(prof, names)
        shape_of = {v: k for k, v in names.items()}
        for label, v in sorted(split.items(), key=lambda kv: -kv[1]):
            nk = shape_of.get(label)
            # Every layer's GEMM of that projection was summed; the LM head runs on the last tokens only.
            rate = (f"  {2.0 * n * nk[0] * nk[1] * layers / (v * 1e-6) / 1e12:7.0f} TFLOP/s"
                    if nk and label != "lm_head" else "")
            print(f"    gemm {label:<22}{v / 1e3:9.3f} ms{rate}")
    for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {v / 1e3:9.3f} ms  {k[:100]}")
    print(flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config_dir")
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--chunks", default="8192", help="prefill chunk sizes in tokens, comma separated")
    ap.add_argument("--reps", type=int, default=3, help="unprofiled runs of each chunk (the median is printed)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:MODULE.ATTR=VALUE[;...]",
                    help="after the default, profile each chunk again with these module attributes set (a Python "
                         "literal each; restored after), e.g. 'plain:engine_attention_triton.extend_attention."
                         "HEAVY_BLOCKS_FIRST=False'; repeatable")
    ap.add_argument("--no-fast-accum", action="store_true",
                    help="shorthand for --variant 'promoted:quant_config.fast_accum=False' (the fp8 plugin's "
                         "fast_accum option, on by default, off on the loaded model)")
    ap.add_argument("--extra", default="{}", help="more ServerArgs as JSON")
    a = ap.parse_args()
    chunks = [int(c) for c in a.chunks.split(",")]
    from engine.config import ServerArgs
    from engine.managers.scheduler import Scheduler

    biggest = max(chunks)
    args = ServerArgs.from_dict({"model_path": a.config_dir, "load_format": "dummy", "skip_tokenizer_init": True,
                                 "attention": a.attention, "disable_cuda_graph": True, "quant": a.quant,
                                 "chunked_prefill_size": biggest, "max_prefill_tokens": max(biggest, 16384),
                                 **json.loads(a.extra)})
    sched = Scheduler(args, a.config_dir, None)
    on_gpu = sched.runner.device.type == "cuda"
    names, layers = projections(a.config_dir)
    quant_configs = {id(c): c for m in sched.runner.model.modules()
                     for c in [getattr(getattr(m, "quant_method", None), "config", None)] if c is not None}
    variants = [("default", [])] + [parse_variant(v, list(quant_configs.values())) for v in a.variant]
    if a.no_fast_accum:
        variants.append(parse_variant("promoted:quant_config.fast_accum=False", list(quant_configs.values())))
    for label, sets in variants:
        saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in sets]
        try:
            for mod, attr, value in sets:
                setattr(mod, attr, value)
            for tokens in chunks:
                profile_chunk(sched, tokens, a.input_len, a.reps, on_gpu, names, layers, label)
        except Exception as exc:  # noqa: BLE001 - a variant the device or torch build cannot run: the next one
            print(f"{label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        finally:
            for mod, attr, value in saved:
                setattr(mod, attr, value)


def parse_variant(text: str, quant_configs: list[Any]) -> tuple[str, list[tuple[Any, str, Any]]]:
    """``LABEL:pkg.module.ATTR=VALUE;...`` -> (label, [(object, attr, value), ...]); the module
    ``quant_config`` stands for the model's quantization config objects (every linear's
    ``quant_method.config``), e.g. ``quant_config.fast_accum=False``."""
    import ast
    import importlib

    label, _, body = text.partition(":")
    sets = []
    for item in filter(None, body.split(";")):
        path, eq, value = item.partition("=")
        module, _, attr = path.strip().rpartition(".")
        if not eq or not module:
            raise SystemExit(f"profile_prefill.py: error: --variant {text!r}: expected LABEL:module.ATTR=VALUE")
        targets = quant_configs if module == "quant_config" else [importlib.import_module(module)]
        if not targets or not all(hasattr(t, attr) for t in targets):
            raise SystemExit(f"profile_prefill.py: error: --variant {text!r}: {module} has no attribute {attr}")
        sets.extend((t, attr, ast.literal_eval(value.strip())) for t in targets)
    return label, sets

if __name__ == "__main__":
    main()
