"""The ``sharegpt-file`` dataset: conversations from a local ShareGPT-format JSON file.

The file is a list of ``{"conversations": [{"from": "human" | "gpt", "value": ...}, ...]}``
records (SGLang's ShareGPT_V3 layout). It is never downloaded: pass ``--dataset-path``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from engine.bench.requests import BenchRequest, TokenizerLike

# SGLang's ShareGPT filter: drop trivially short pairs, and without a context length drop
# what would not fit a 2k-context model.
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048


def sample_sharegpt_requests(
    dataset_path: str | None,
    num_prompts: int,
    tokenizer: TokenizerLike,
    seed: int,
    fixed_output_len: int | None = None,
    context_len: int | None = None,
    return_text: bool = True,
) -> list[BenchRequest]:
    """First human turn and the reply after it from a local ShareGPT JSON file.

    The reply's token count is the output length unless ``fixed_output_len`` is given.
    Pairs are shuffled with ``seed`` and filtered like SGLang: fewer than 4 prompt or output
    tokens are dropped; without ``context_len`` a prompt over 1024 tokens or a pair over 2048
    is dropped, with it a pair over ``context_len`` is.
    """
    if not dataset_path:
        raise ValueError("dataset 'sharegpt-file' needs --dataset-path (a ShareGPT JSON file)")
    path = Path(dataset_path)
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path {dataset_path!r} is not a file")
    if fixed_output_len is not None and fixed_output_len < SHAREGPT_MIN_TOKENS:
        raise ValueError(
            f"--sharegpt-output-len must be >= {SHAREGPT_MIN_TOKENS}, got {fixed_output_len}"
        )
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {dataset_path!r} is not valid JSON: {exc}") from exc
    if not isinstance(records, list):
        raise ValueError(f"--dataset-path {dataset_path!r}: expected a JSON list of conversations")

    pairs = [pair for pair in map(_first_exchange, records) if pair is not None]
    random.Random(seed).shuffle(pairs)

    requests: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(requests) == num_prompts:
            break
        prompt_ids = tokenizer.encode(prompt)
        prompt_len = len(prompt_ids)
        if fixed_output_len is None:
            out_len = len(tokenizer.encode(reply, add_special_tokens=False))
        else:
            out_len = fixed_output_len
        if prompt_len < SHAREGPT_MIN_TOKENS or out_len < SHAREGPT_MIN_TOKENS:
            continue
        if context_len is None:
            too_long = (
                prompt_len > SHAREGPT_MAX_PROMPT_TOKENS
                or prompt_len + out_len > SHAREGPT_MAX_TOTAL_TOKENS
            )
        else:
            too_long = prompt_len + out_len > context_len
        if not too_long:
            chosen = prompt if return_text else prompt_ids
            requests.append(BenchRequest(chosen, prompt_len, out_len))
    return requests


def _first_exchange(record: Any) -> tuple[str, str] | None:
    """The first human turn answered by a gpt turn, with that answer; None if there is none."""
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations", record.get("conversation"))
    if not isinstance(turns, list):
        return None
    for first, second in zip(turns, turns[1:]):
        if (
            isinstance(first, dict)
            and isinstance(second, dict)
            and first.get("from") == "human"
            and second.get("from") == "gpt"
            and isinstance(first.get("value"), str)
            and isinstance(second.get("value"), str)
        ):
            return first["value"], second["value"]
    return None
