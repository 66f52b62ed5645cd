"""torch.profiler summary of batch-1 decode steps (CUDA graphs off, so kernels are visible).

usage: python scripts/profile_decode.py CONFIG_DIR [--attention triton] [--steps 20]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config_dir")
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from engine.bench.one_batch import run_one
    from engine.config import ServerArgs
    from engine.managers.scheduler import Scheduler

    args = ServerArgs.from_dict({"model_path": a.config_dir, "load_format": "dummy", "skip_tokenizer_init": True,
                                 "attention": a.attention, "disable_cuda_graph": True})
    sched = Scheduler(args, a.config_dir)
    run_one(sched, 1, 128, 8)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_one(sched, 1, 128, a.steps)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


if __name__ == "__main__":
    main()
