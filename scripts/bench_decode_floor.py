"""How fast the batch-1 decode step could be with its latency-bound launches gone: an analysis, not
a way to run a model (the variants' outputs are meaningless).

Variants (comma-separated; each name may combine both parts, e.g. ``no_attn_no_topk``):
- ``base``: the step as it is;
- ``no_attn``: a decode step's attention (the prologue, stage 1 and the merge) replaced by a view
  of the query, which the output projection then reads at once;
- ``no_topk``: the MoE top-k launch replaced by fixed experts (ids 0, E/k, 2E/k, ..., weights 1/k);
- ``stage_<how>`` (not an analysis of a removal: outputs stay right): the next layer's qkv weight
  staged in L2 while this layer's attention runs, from a side stream forked after this layer's qkv
  projection and joined at the end of the model, as ``bench_l2_retention.stage_in_l2(w, how)``
  stages it (``how``: ``pf``, ``pf5``, ``ld64``, ...).

One scheduler (dummy weights, CUDA graphs for batch 1), the decode graph recaptured per variant,
``rounds`` rounds; prints one JSON line per run: ``engine bench one-batch``'s median decode step and
how often each replacement ran (eager calls, graph captures; zero where the variant keeps it).
usage: python3 scripts/bench_decode_floor.py MODEL_DIR base,no_topk,no_attn,no_attn_no_topk [ROUNDS]
(``ATTN=torch_native`` picks another backend, e.g. to try it on the CPU with a tiny config)."""
import gc
import json
import os
import sys

import torch
from bench_l2_retention import stage_in_l2  # this script's folder is on sys.path
from engine_models_llama.llama import LlamaAttention, LlamaModel

import engine.layers.moe.layer as moe_layer
from engine.bench.one_batch import run_one
from engine.config import ServerArgs
from engine.layers.radix_attention import RadixAttention
from engine.managers.scheduler import Scheduler

model = sys.argv[1]
names = sys.argv[2].split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
ORIG_QKV = RadixAttention.forward_qkv
ORIG_SEL = moe_layer.select_experts
ORIG_MODEL = LlamaModel.forward
_fixed = {}
#: how often each replacement ran in the current variant (0 would mean it no longer takes effect)
calls = {"attn": 0, "topk": 0, "stage": 0}
#: the staging variant's ``how`` ("" for none), each layer id's next layer's qkv weight, the side
#: stream, and whether this forward forked it (staging runs only while a CUDA graph is captured)
staging = {"how": "", "next": {}, "side": None, "forked": False}


def qkv_staged(self, qkv, positions, forward_batch, rotary_emb, q_norm=None, k_norm=None):
    stage_next(self.layer_id, qkv, forward_batch)
    return ORIG_QKV(self, qkv, positions, forward_batch, rotary_emb, q_norm, k_norm)


def qkv_view(self, qkv, positions, forward_batch, rotary_emb, q_norm=None, k_norm=None):
    stage_next(self.layer_id, qkv, forward_batch)
    if forward_batch.forward_mode.is_decode():
        calls["attn"] += 1
        return qkv[:, : self.num_heads * self.head_dim]
    return ORIG_QKV(self, qkv, positions, forward_batch, rotary_emb, q_norm, k_norm)


def fixed_experts(router_logits, top_k, renormalize, pdl=False):
    t, e = router_logits.shape
    if t != 1:
        return ORIG_SEL(router_logits, top_k, renormalize, pdl=pdl)
    calls["topk"] += 1
    key = (top_k, e, router_logits.device)
    if key not in _fixed:
        ids = (torch.arange(top_k, device=router_logits.device, dtype=torch.int32) * (e // top_k)).view(1, top_k)
        _fixed[key] = (torch.full((1, top_k), 1.0 / top_k, device=router_logits.device), ids)
    return _fixed[key]


def stage_next(layer_id, qkv, forward_batch):
    """With a ``stage_*`` variant, while capturing a decode graph: fork the side stream here (this
    layer's qkv projection is queued) and stage the next layer's qkv weight from it."""
    nxt = staging["next"].get(layer_id)
    if staging["how"] and nxt is not None and forward_batch.forward_mode.is_decode() and qkv.is_cuda \
            and torch.cuda.is_current_stream_capturing():
        staging["side"] = staging["side"] or torch.cuda.Stream()
        staging["side"].wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(staging["side"]):
            stage_in_l2(nxt, staging["how"], _sink(nxt.device))
        calls["stage"] += 1
        staging["forked"] = True


def model_joined(self, *args, **kwargs):
    out = ORIG_MODEL(self, *args, **kwargs)
    if staging["forked"]:
        torch.cuda.current_stream().wait_stream(staging["side"])
        staging["forked"] = False
    return out


def _sink(device):
    key = ("sink", device)
    if key not in _fixed:
        _fixed[key] = torch.empty(1 << 16, device=device)
    return _fixed[key]


LlamaModel.forward = model_joined
args = ServerArgs.from_dict({"model_path": model, "load_format": "dummy", "skip_tokenizer_init": True,
                             "attention": os.environ.get("ATTN", "triton"), "log_level": "warning", "cuda_graph_max_bs": 1})
sched = Scheduler(args, model)
attention = [m for m in sched.runner.model.modules() if isinstance(m, LlamaAttention)]
staging["next"] = {a.attn.layer_id: b.qkv_proj.weight for a, b in zip(attention, attention[1:], strict=False)}
for rnd in range(rounds):
    for n in names:
        RadixAttention.forward_qkv = qkv_view if "no_attn" in n else qkv_staged
        moe_layer.select_experts = fixed_experts if "no_topk" in n else ORIG_SEL
        staging["how"] = n.split("stage_", 1)[1] if "stage_" in n else ""
        calls.update(attn=0, topk=0, stage=0)
        sched.runner.cuda_graph_runner = None
        gc.collect()
        sched.runner.cuda_graph_runner = sched.runner._maybe_capture_graphs()
        run_one(sched, 1, 32, 8)
        res = run_one(sched, 1, 128, 256)
        print(json.dumps({"model": os.path.basename(model), "round": rnd, "variant": n,
                          "decode_ms": round(res.median_decode_latency_s * 1e3, 4), "replaced": dict(calls)}), flush=True)
