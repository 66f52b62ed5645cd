"""Diagnoses a speculative-decoding divergence on a device: is it numerics (an extend forward
breaking near-ties differently from decode steps) or a bug (wrong logits, KV corruption)?

    python3 scripts/diag_spec.py --model tiny|default --attention triton|flashinfer|torch_native

For each prompt: the plain greedy output S (decode steps), then
  1. one EXTEND forward over the whole of S: where its argmax disagrees with the token the
     decode steps chose, and by how much (the logit gap; a near-tie is numerics, a large gap is a bug);
  2. verify-shaped extends (prefix S[:p] in the KV cache, then S[p:p+5]) against (1);
  3. speculation (ngram) with and without verify graphs: the first token where it leaves S.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch

from engine.model_executor.forward_batch import ForwardBatch, ForwardMode
from engine.testing.harness import generate_greedy, make_scheduler


def _forward(runner: Any, rows: list[tuple[list[int], int]], full: bool) -> Any:
    """One EXTEND forward; ``rows``: (tokens of the whole sequence, prefix length already cached in
    the row's slots). Returns (out, per-row slot lists)."""
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    slots = pool.alloc(len(rows))
    input_ids: list[int] = []
    locs = []
    for slot, (seq, _) in zip(slots, rows):
        loc = alloc.alloc(len(seq))
        pool.write(slot, 0, loc)
        locs.append(loc)
    # Fill every prefix first (one extend per row), then run the rows' suffixes together.
    pre = [(slot, seq, p, loc) for slot, (seq, p), loc in zip(slots, rows, locs) if p > 0]
    for slot, seq, p, loc in pre:
        fb = ForwardBatch.build(ForwardMode.EXTEND, seq[:p], [slot], [p], [0], loc[:p], runner.device)
        runner.forward(fb)
    for seq, p in rows:
        input_ids.extend(seq[p:])
    out_loc = torch.cat([loc[p:] for (seq, p), loc in zip(rows, locs)])
    fb = ForwardBatch.build(ForwardMode.EXTEND, input_ids, list(slots), [len(s) for s, _ in rows],
                            [p for _, p in rows], out_loc, runner.device, num_extend_reqs=len(rows),
                            return_logprob=full)
    out = runner.forward(fb)
    pool.free(slots) if hasattr(pool, "free") else None
    alloc.free(torch.cat(locs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--platform", default="cuda")
    a = ap.parse_args()
    if a.model == "tiny":
        import tempfile

        from engine.testing.checkpoints import make_tiny_checkpoint

        path = make_tiny_checkpoint(tempfile.mkdtemp(), "LlamaForCausalLM", hidden_size=256, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=512)
        rng = random.Random(5)
        phrase = [rng.randrange(1000) for _ in range(20)]
        prompts = [phrase * 4, [rng.randrange(1000) for _ in range(9)], phrase[:7] * 6 + [1, 2, 3],
                   [rng.randrange(1000) for _ in range(150)], phrase * 2 + phrase[:10]]
    else:
        from transformers import AutoTokenizer

        from engine.model_executor.checkpoint import resolve_checkpoint
        from engine.testing.default_model import CHATS, chat_prompt_ids

        path = resolve_checkpoint(None)
        tok: Any = AutoTokenizer.from_pretrained(path)
        passage = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
                   "step. All that glitters is not gold. Where there is a will, there is a way.")
        copy = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{passage}"}]
        prompts = [chat_prompt_ids(tok, c) for c in [*CHATS, copy]]
    kw = dict(platform=a.platform, attention=a.attention, max_total_tokens=20000, dtype=a.dtype)
    n = a.max_new_tokens
    eager = make_scheduler(path, disable_cuda_graph=True, **kw)
    plain = generate_greedy(eager, prompts, n)
    plain_graphs = generate_greedy(make_scheduler(path, **kw), prompts, n)
    print(f"model={a.model} attention={a.attention} dtype={eager.runner.dtype if hasattr(eager.runner, 'dtype') else '?'}")
    print("plain: decode graphs == eager:", plain_graphs == plain,
          [next((j for j, (x, y) in enumerate(zip(g, e)) if x != y), None) for g, e in zip(plain_graphs, plain)])
    runner = eager.runner
    for i, (prompt, gen) in enumerate(zip(prompts, plain)):
        seq = prompt + gen
        out = _forward(runner, [(seq, 0)], full=True)
        logits = out.full_logits.float()
        lo = len(prompt) - 1
        pred = logits[lo: len(seq) - 1].argmax(-1).tolist()
        bad = [(j, gen[j], pred[j]) for j in range(len(gen) - 1 + 1) if j < len(pred) and pred[j] != gen[j]]
        gaps = [float(logits[lo + j, p] - logits[lo + j, g]) for j, g, p in bad]
        top2 = logits[lo: len(seq) - 1].topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1])
        print(f"prompt {i} (len {len(prompt)}): full-extend argmax != decode at {len(bad)}/{len(gen)} "
              f"positions {[j for j, _, _ in bad][:8]} gaps {[round(g, 4) for g in gaps][:8]}; "
              f"median top1-top2 margin {float(margin.median()):.4f}")
        # Verify-shaped extends: prefix cached, then 5 tokens.
        diffs, flips = [], 0
        for p in range(len(prompt), len(seq) - 5, 7):
            o2 = _forward(runner, [(seq[: p + 5], p)], full=True).full_logits.float()
            ref = logits[p: p + 5]
            diffs.append(float((o2 - ref).abs().max()))
            flips += int((o2.argmax(-1) != ref.argmax(-1)).sum())
        print(f"  verify-shaped extends vs full extend: max |dlogit| {max(diffs, default=0):.5f}, argmax flips {flips}")
    for graphs in (False, True):
        for k in (4,):
            s = make_scheduler(path, speculative_algorithm="ngram", speculative_num_steps=k,
                               disable_cuda_graph=not graphs, **kw)
            got = generate_greedy(s, prompts, n)
            first = [next((j for j, (x, y) in enumerate(zip(g, e)) if x != y), None) for g, e in zip(got, plain)]
            st = s.speculator.stats
            print(f"spec ngram k={k} verify graphs={graphs}: equal={got == plain} first diff per prompt {first} "
                  f"accept {st.mean_accept_length():.2f}")
            if a.model == "default":
                s2 = make_scheduler(path, speculative_algorithm="draft", speculative_draft_model_path=path,
                                    speculative_num_steps=4, disable_cuda_graph=not graphs, **kw)
                got2 = generate_greedy(s2, prompts, n)
                st2 = s2.speculator.stats
                first2 = [next((j for j, (x, y) in enumerate(zip(g, e)) if x != y), None) for g, e in zip(got2, plain)]
                print(f"  draft=target graphs={graphs}: equal={got2 == plain} first diff {first2} "
                      f"accepted {st2.accepted_tokens}/{st2.proposed_tokens}")


if __name__ == "__main__":
    main()
