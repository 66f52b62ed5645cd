"""Hugging Face transformers baselines for docs/benchmarks.md, on the same config and device.

Measures ``generate`` decode throughput at batch 1 (eager, and with a static cache plus
``torch.compile(mode="reduce-overhead")``) and at a larger batch, with random weights.
usage: python benchmarks/bench_hf_baseline.py CONFIG_DIR [--input-len 128] [--output-len 256]
       [--batch 64 --batch-input-len 1024 --batch-output-len 128] [--skip-compile] [--result-file F]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.bench.results import append_rows


def _time_generate(model, input_ids, new_tokens, **kw):  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    torch.cuda.synchronize()
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config_dir")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batch-input-len", type=int, default=1024)
    ap.add_argument("--batch-output-len", type=int, default=128)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(a.config_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    vocab = config.vocab_size
    results = {"device": torch.cuda.get_device_name(), "model_path": a.config_dir}
    ids = torch.randint(0, vocab, (1, a.input_len), device="cuda")
    _time_generate(model, ids, 8)
    t = _time_generate(model, ids, a.output_len)
    results["hf_eager_bs1_tok_s"] = a.output_len / t
    print(f"HF eager batch 1: {results['hf_eager_bs1_tok_s']:.1f} tok/s", flush=True)
    if a.batch > 0:  # --batch 0 skips the batched eager run
        big = torch.randint(0, vocab, (a.batch, a.batch_input_len), device="cuda")
        t = _time_generate(model, big, a.batch_output_len)
        results[f"hf_eager_bs{a.batch}_tok_s"] = a.batch * a.batch_output_len / t
        print(f"HF eager batch {a.batch} ({a.batch_input_len} in / {a.batch_output_len} out): "
              f"{results[f'hf_eager_bs{a.batch}_tok_s']:.1f} output tok/s", flush=True)
    if not a.skip_compile:
        # transformers compiles the decode forward itself when the cache is static.
        from transformers import CompileConfig

        model.generation_config.compile_config = CompileConfig(mode="reduce-overhead", fullgraph=True)
        try:
            # Warm up with the timed shapes: a different output length sizes the static cache
            # differently and recompiles inside the timed run.
            for _ in range(2):
                _time_generate(model, ids, a.output_len, cache_implementation="static")
            t = _time_generate(model, ids, a.output_len, cache_implementation="static")
            results["hf_compiled_static_bs1_tok_s"] = a.output_len / t
            print(f"HF static cache + torch.compile batch 1: {results['hf_compiled_static_bs1_tok_s']:.1f} tok/s", flush=True)
        except Exception as exc:  # report and keep the eager figures
            results["hf_compiled_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print("HF compiled run failed:", results["hf_compiled_error"], flush=True)
    print(json.dumps(results))
    # One row, its batch-1 eager figure the one engine bench report shows by default ("figure" picks another).
    append_rows(a.result_file, {"bench": "hf-baseline", "area": "decode", **results})


if __name__ == "__main__":
    main()
