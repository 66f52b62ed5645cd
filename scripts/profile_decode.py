"""torch.profiler summary of decode steps: GPU time per step by kernel class and the top kernels.

CUDA graphs are off so every kernel is attributed; the sum of kernel time per step is the
device-busy time a captured graph would need. The first line also gives the median wall time of a
step in the unprofiled warm-up run (as `engine bench one-batch` times it), for comparison.

usage: python scripts/profile_decode.py CONFIG_DIR [--attention triton] [--batch-size 1]
       [--input-len 128] [--steps 20] [--timeline 40] [--lora-paths NAME=PATH ... --lora-name NAME ...]

``--tp-size N`` runs N ranks, one process each, as ``engine bench one-batch --tp-size N`` does;
every rank runs the same steps and rank 0 profiles and prints (pass ``--extra
'{"enable_custom_all_reduce": true}'`` for the one-shot all-reduce).

``--timeline N`` also prints N consecutive kernels from the middle of the last decode step, in
launch order, with each one's duration and the idle gap before it (with ``--extra
'{"disable_cuda_graph": false}'`` these are the kernels of a graph replay), and the step's total
kernel time against its total idle time between kernels.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def classify(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("nccl", "all_reduce", "allreduce")):
        return "communication"
    if any(k in low for k in ("_shrink", "_expand")):  # the LoRA backend's SGMV kernels
        return "lora"
    if any(k in low for k in ("nvjet", "gemm", "gemv", "cutlass", "sm90_xmma", "splitk")):
        return "gemm"
    if any(k in low for k in ("attn", "attention", "decode", "extend", "prefill", "flashinfer")):
        return "attention"
    if any(k in low for k in ("rms", "norm", "silu", "rotary", "rope")):
        return "fused layer kernels"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config_dir")
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quant", default=None, help="quantization plugin, as engine serve --quant")
    ap.add_argument("--timeline", type=int, default=0, help="print this many kernels of one step in order")
    ap.add_argument("--timeline-at", default="middle", choices=("start", "middle", "end", "seam"),
                    help="which kernels of the step --timeline prints (end: the last ones and the idle after the "
                         "step; seam: from the LM head of the last step but one into the next step, as run)")
    ap.add_argument("--overlap", action="store_true",
                    help="profile the decode steps as the overlapped loop runs them (engine bench one-batch's default "
                         "on CUDA): each step launched before the previous one's tokens reach the host")
    ap.add_argument("--extra", default="{}", help="more ServerArgs as JSON, e.g. '{\"kv_cache_dtype\": \"fp8_e4m3\"}' "
                    "(plugin switches are JSON true/false: '{\"plugin_options\": {\"cuda\": {\"pdl\": false}}}')")
    ap.add_argument("--warm-input-len", type=int, default=None,
                    help="prompt length of the unprofiled warm-up (default --input-len); shorter compiles the same "
                         "kernels sooner, but then the warm-up's step time is not the profiled context's")
    ap.add_argument("--prefill-table", action="store_true",
                    help="also print the profiled prefill's kernel time by class and its top kernels")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (one process each; rank 0 prints)")
    ap.add_argument("--lora-paths", nargs="+", default=None, metavar="NAME=PATH",
                    help="LoRA adapters loaded at start, as engine serve --lora-paths")
    ap.add_argument("--lora-name", nargs="+", default=None, metavar="NAME",
                    help="adapters the requests run on, round-robin (as engine bench one-batch --lora-name)")
    a = ap.parse_args()
    from engine.config import ServerArgs

    args = ServerArgs.from_dict({"model_path": a.config_dir, "load_format": "dummy", "skip_tokenizer_init": True,
                                 "attention": a.attention, "disable_cuda_graph": True, "quant": a.quant,
                                 "tp_size": a.tp_size, **({"lora_paths": a.lora_paths} if a.lora_paths else {}),
                                 **json.loads(a.extra)})
    from engine.plugins import check_plugin_options

    check_plugin_options(args.plugin_options)  # as the engine's start-up checks them
    if args.tp_size * args.pp_size == 1:
        profile_steps(a, args, None, lead=True)
        return
    import torch.multiprocessing as mp

    from engine.distributed.ranks import init_method, node_placements

    placements = list(node_placements(args, 0, init_method(args, 0)))
    mp.spawn(_rank, args=(a, args, placements), nprocs=len(placements))


def _rank(index: int, a: argparse.Namespace, args: object, placements: list) -> None:
    from engine.managers.scheduler_process import join_replica

    platform = join_replica(args, placements[index])
    profile_steps(a, args, platform, lead=placements[index].rank == 0)


def profile_steps(a: argparse.Namespace, args: object, platform: object, lead: bool) -> None:
    """Warms up, then profiles a prefill alone and a prefill with ``a.steps`` decode steps (every
    rank runs them; only the lead profiles and prints)."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    from engine.bench.kernel_times import kernel_times, print_by_class
    from engine.bench.one_batch import run_one
    from engine.managers.scheduler import Scheduler

    sched = Scheduler(args, a.config_dir, platform)
    # The warm-up runs the steps unprofiled, as engine bench one-batch does (overlap as the scheduler
    # has it): its median step is the wall time the kernel table below is compared with.
    warm_len = a.warm_input_len or a.input_len
    warm = run_one(sched, a.batch_size, warm_len, max(4, a.steps + 1), lora_names=a.lora_name)
    # Profile the prefill alone, then prefill + decode; the difference is the decode steps.
    on_gpu = sched.runner.device.type == "cuda"
    activity = ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU  # CPU: a dry run of the script

    def profiled() -> contextlib.AbstractContextManager:
        return profile(activities=[activity]) if lead else contextlib.nullcontext()

    with profiled() as pre:
        run_one(sched, a.batch_size, a.input_len, 1, overlap=False, lora_names=a.lora_name)
    with profiled() as prof:
        run_one(sched, a.batch_size, a.input_len, a.steps + 1, overlap=a.overlap, lora_names=a.lora_name)
    if not lead:
        return

    base, full = kernel_times(pre, on_gpu), kernel_times(prof, on_gpu)
    if a.prefill_table:
        print_table(f"prefill of {a.batch_size} x {a.input_len} tokens (chunks of at most "
                    f"{args.chunked_prefill_size}), GPU kernel time", base, a.batch_size * a.input_len)
    per_step = {k: (v - base.get(k, 0.0)) / a.steps for k, v in full.items()}
    total = sum(per_step.values())
    graphs = "graphs" if sched.runner.cuda_graph_runner is not None else "eager"
    print(f"decode, batch {a.batch_size}, context ~{a.input_len}, attention {a.attention}, quant {a.quant}, "
          f"tp {a.tp_size}: GPU kernel time per step {total / 1e3:.3f} ms; unprofiled step "
          f"{warm.median_decode_latency_s * 1e3:.3f} ms ({graphs}, overlap {'on' if warm.overlap else 'off'}"
          f"{'' if warm_len == a.input_len else f', warm-up context ~{warm_len}'})")
    print_by_class(per_step, classify, total, width=8)
    print("top kernels (per step):")
    for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {v:9.1f} us  {k[:110]}")
    if a.timeline and on_gpu:
        print_timeline(prof, a.timeline, a.steps + 1, a.timeline_at)


def print_table(title: str, times: dict[str, float], tokens: int) -> None:
    """Kernel time (microseconds by kernel name) by class and the top kernels, with tokens a second."""
    from engine.bench.kernel_times import print_by_class

    total = sum(times.values())
    print(f"{title}: {total / 1e3:.3f} ms ({tokens / max(total, 1e-9) * 1e6:,.0f} tokens/s of kernel time)")
    print_by_class(times, classify, total)
    for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {v / 1e3:9.3f} ms  {k[:110]}")


def print_timeline(prof, count: int, steps: int, at: str = "middle") -> None:
    """``count`` kernels from the middle (or ``at`` the start or end) of the last of ``steps`` decode
    steps, in order."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return
    if at == "seam":
        # The LM head is the step's one long weight read; print from two kernels before the last but
        # one into the step after it (steps may not be separated by idle time when overlapped).
        heads = [i for i, (start, end, _) in enumerate(spans) if end - start > 100.0]
        first = max(0, heads[-2] - 2) if len(heads) >= 2 else 0
        t0 = spans[first][0]
        print(f"  {'start':>7} {'gap us':>7} {'dur us':>7} {'ends +':>7}  kernel (start: us from the first)")
        for i in range(first, min(len(spans), first + count)):
            start, end, name = spans[i]
            gap = start - spans[i - 1][1] if i else 0.0
            print(f"  {start - t0:7.2f} {gap:7.2f} {end - start:7.2f} {end - spans[i - 1][1] if i else 0.0:7.2f}  "
                  f"{name[:80]}")
        return
    # Steps are separated by the largest idle gaps (host work between steps); take the last step.
    gaps = sorted(range(1, len(spans)), key=lambda i: spans[i][0] - spans[i - 1][1], reverse=True)
    cuts = sorted(gaps[:steps - 1])
    step = spans[cuts[-1]:] if cuts else spans
    if at == "end" and len(cuts) >= 2:
        # The last step's end is followed by nothing; take the one before it, and its idle after.
        step = spans[cuts[-2]:cuts[-1]]
        print(f"idle after the step, before the next one's first kernel: "
              f"{(spans[cuts[-1]][0] - step[-1][1]):.2f} us")
    busy = sum(end - start for start, end, _ in step)
    idle = sum(max(0.0, step[i][0] - step[i - 1][1]) for i in range(1, len(step)))
    print(f"last step: {len(step)} kernels, {busy / 1e3:.3f} ms busy, {idle / 1e3:.3f} ms idle between them, "
          f"{(step[-1][1] - step[0][0]) / 1e3:.3f} ms from the first kernel's start to the last one's end")
    mid = {"start": 0, "end": max(0, len(step) - count)}.get(at, max(0, len(step) // 2 - count // 2))
    # With programmatic dependent launch a kernel starts before the previous one ends (a negative
    # gap) and its duration includes its wait; "ends +" is its end past the previous kernel's end.
    t0 = step[mid][0]
    print(f"  {'start':>7} {'gap us':>7} {'dur us':>7} {'ends +':>7}  kernel (#{mid} on; start: us from the first)")
    for i in range(mid, min(len(step), mid + count)):
        start, end, name = step[i]
        gap = start - step[i - 1][1] if i else 0.0
        after = end - step[i - 1][1] if i else end - start
        print(f"  {start - t0:7.2f} {gap:7.2f} {end - start:7.2f} {after:7.2f}  {name[:80]}")


if __name__ == "__main__":
    from engine.errors import ConfigError

    try:
        main()
    except (ConfigError, json.JSONDecodeError) as exc:
        # Bad input (a ServerArgs or plugin-option value in --extra, or --extra not JSON): one line,
        # exit status 2, as the engine's CLI does. JSON has no YAML on/off: plugin switches are true/false.
        print(f"profile_decode.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
