"""Recording output and prompt logprobs on requests after a forward pass."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.layers.logits_processor import LogitsProcessorOutput
    from engine.layers.sampler import SampleOutput
    from engine.managers.schedule_batch import Req
    from engine.model_executor.forward_batch import ForwardBatch


def record_output_logprobs(req: Req, row: int, sample: SampleOutput) -> None:
    """Appends the logprob (and top alternatives) of the token just sampled for ``row``."""
    if not req.return_logprob or sample.next_token_logprobs is None:
        return
    token = req.output_ids[-1]
    req.output_token_logprobs.append((float(sample.next_token_logprobs[row]), token))
    k = req.top_logprobs_num
    if k > 0 and sample.top_logprobs is not None:
        values = sample.top_logprobs[row, :k].tolist()
        ids = sample.top_logprob_ids[row, :k].tolist()
        req.output_top_logprobs.append(list(zip(values, ids)))
    else:
        req.output_top_logprobs.append([])


def record_prompt_logprobs(req: Req, row: int, fb: ForwardBatch, logits: LogitsProcessorOutput) -> None:
    """Adds logprobs of prompt tokens this extend row can score (chunk by chunk).

    Logits at absolute position ``j`` score prompt token ``j + 1``. The entry for
    the prompt's token 0 has no logprob (None).
    """
    if logits.full_logits is None:
        return
    assert fb.extend_start_loc is not None and fb.extend_prefix_lens_cpu is not None
    prompt = req.origin_input_ids
    start_row = int(fb.extend_start_loc[row])
    prefix = fb.extend_prefix_lens_cpu[row]
    ext = fb.extend_seq_lens_cpu[row] if fb.extend_seq_lens_cpu else 0
    if req.input_token_logprobs is None:
        req.input_token_logprobs, req.input_top_logprobs = [], []
    if req.logprob_start_len == 0 and prefix == 0:
        req.input_token_logprobs.append((None, prompt[0]))
        req.input_top_logprobs.append([])
    positions = [j for j in range(prefix, prefix + ext)
                 if j + 1 < len(prompt) and j + 1 >= max(req.logprob_start_len, 1)]
    if not positions:
        return
    rows = torch.tensor([start_row + j - prefix for j in positions], device=logits.full_logits.device)
    logprobs = torch.log_softmax(logits.full_logits[rows], dim=-1)
    targets = torch.tensor([prompt[j + 1] for j in positions], device=logprobs.device)
    chosen = logprobs.gather(1, targets.view(-1, 1)).view(-1).tolist()
    k = req.top_logprobs_num
    tops = logprobs.topk(k, dim=-1) if k > 0 else None
    for n, j in enumerate(positions):
        req.input_token_logprobs.append((chosen[n], prompt[j + 1]))
        if tops is not None:
            req.input_top_logprobs.append(list(zip(tops.values[n].tolist(), tops.indices[n].tolist())))
        else:
            req.input_top_logprobs.append([])
