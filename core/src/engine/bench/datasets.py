"""Request generators for ``engine bench``: random, generated shared prefix, and the
dispatch to ``sharegpt-file`` (engine.bench.sharegpt).

Every generator is seeded and returns ``list[BenchRequest]``. Prompts are token-id lists
(exact lengths, usable with ``--skip-tokenizer-init`` servers) or text when a tokenizer is
given and the caller asks for text. Nothing here downloads anything.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.bench.requests import BenchRequest, TokenizerLike

if TYPE_CHECKING:
    import numpy as np

DATASET_NAMES = ("random", "sharegpt-file", "generated-shared-prefix")


@dataclass
class DatasetArgs:
    """Dataset flags shared by the bench commands; names mirror SGLang's bench_serving flags."""

    # One of DATASET_NAMES (--dataset-name).
    dataset_name: str = "random"
    # ShareGPT-format JSON file for "sharegpt-file" (--dataset-path); never downloaded.
    dataset_path: str | None = None
    # Number of requests for "random" and "sharegpt-file" (--num-prompts).
    num_prompts: int = 1000
    # Seeds prompt sampling, shuffling and Poisson arrivals (--seed).
    seed: int = 1
    # Overrides every ShareGPT output length (--sharegpt-output-len).
    sharegpt_output_len: int | None = None
    # Drop ShareGPT pairs longer than this instead of applying the fixed 1024/2048 limits
    # (--sharegpt-context-len).
    sharegpt_context_len: int | None = None
    # Longest prompt for "random" (--random-input-len).
    random_input_len: int = 1024
    # Longest output for "random" (--random-output-len).
    random_output_len: int = 1024
    # Lengths are drawn uniformly from [len * ratio, len] (--random-range-ratio).
    random_range_ratio: float = 0.0
    # Vocabulary to draw token ids from when no tokenizer is loaded (--vocab-size; not an
    # SGLang flag, which always loads a tokenizer).
    vocab_size: int | None = None
    # generated-shared-prefix shape (--gsp-*): groups x prompts-per-group requests.
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256


def sample_requests(
    args: DatasetArgs, tokenizer: TokenizerLike | None, return_text: bool
) -> list[BenchRequest]:
    """Build the requests that ``args.dataset_name`` names.

    Args:
        args: dataset flags.
        tokenizer: used to count tokens and decode ids; None for tokenizer-less workloads.
        return_text: prompts as text (needs ``tokenizer``) instead of token-id lists.
    """
    name = args.dataset_name
    if name == "random":
        return sample_random_requests(
            num_prompts=args.num_prompts,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            seed=args.seed,
            tokenizer=tokenizer,
            vocab_size=args.vocab_size,
            return_text=return_text,
        )
    if name == "sharegpt-file":
        from engine.bench.sharegpt import sample_sharegpt_requests

        if tokenizer is None:
            raise ValueError(
                "dataset 'sharegpt-file' needs a tokenizer to count prompt and reply tokens; "
                "pass --tokenizer (or drop --skip-tokenizer-init)"
            )
        return sample_sharegpt_requests(
            dataset_path=args.dataset_path,
            num_prompts=args.num_prompts,
            tokenizer=tokenizer,
            seed=args.seed,
            fixed_output_len=args.sharegpt_output_len,
            context_len=args.sharegpt_context_len,
            return_text=return_text,
        )
    if name == "generated-shared-prefix":
        return sample_generated_shared_prefix_requests(
            num_groups=args.gsp_num_groups,
            prompts_per_group=args.gsp_prompts_per_group,
            system_prompt_len=args.gsp_system_prompt_len,
            question_len=args.gsp_question_len,
            output_len=args.gsp_output_len,
            seed=args.seed,
            tokenizer=tokenizer,
            vocab_size=args.vocab_size,
            return_text=return_text,
        )
    hint = " (engine bench never downloads: use 'sharegpt-file' with --dataset-path)"
    raise ValueError(
        f"unknown dataset {name!r}; accepted: {', '.join(DATASET_NAMES)}"
        + (hint if name == "sharegpt" else "")
    )


def sample_random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    tokenizer: TokenizerLike | None = None,
    vocab_size: int | None = None,
    return_text: bool = False,
) -> list[BenchRequest]:
    """Random token prompts with lengths uniform in ``[len * range_ratio, len]``.

    Lengths follow SGLang (``int(len * ratio)`` to ``len`` inclusive) except that the lower
    bound is at least 1: a zero-token prompt or ``max_new_tokens=0`` measures nothing.
    With ``return_text`` the ids are decoded; the server may re-tokenize the text to a
    slightly different length, and ``prompt_len`` stays the drawn target as in SGLang.
    Send ids (``return_text=False``) when lengths must be exact.
    """
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(
            "--random-input-len and --random-output-len must be >= 1, "
            f"got {input_len}, {output_len}"
        )
    _check_text_mode(tokenizer, return_text)
    import numpy as np  # here, not at the top: the engine bench command line imports this module

    rng = np.random.default_rng(seed)
    input_lens = _draw_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _draw_lengths(rng, output_len, range_ratio, num_prompts)
    allowed = _allowed_token_ids(tokenizer, vocab_size)
    requests = []
    for in_len, out_len in zip(input_lens, output_lens):
        ids = rng.choice(allowed, size=int(in_len)).tolist()
        prompt: str | list[int] = ids
        if return_text:
            assert tokenizer is not None  # _check_text_mode guarantees it
            prompt = tokenizer.decode(ids)
        requests.append(BenchRequest(prompt, prompt_len=int(in_len), output_len=int(out_len)))
    return requests


def sample_generated_shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
    tokenizer: TokenizerLike | None = None,
    vocab_size: int | None = None,
    return_text: bool = False,
) -> list[BenchRequest]:
    """``num_groups * prompts_per_group`` questions over a few long random system prompts.

    Exercises prefix caching: each group shares its system prompt exactly (as ids; as text
    the two parts are joined by a blank line and ``prompt_len`` is the encoded length).
    """
    if min(num_groups, prompts_per_group, system_prompt_len, question_len, output_len) < 1:
        raise ValueError("every --gsp-* value must be >= 1")
    _check_text_mode(tokenizer, return_text)
    import numpy as np

    rng = np.random.default_rng(seed)
    allowed = _allowed_token_ids(tokenizer, vocab_size)
    requests: list[BenchRequest] = []
    for _ in range(num_groups):
        system_ids = rng.choice(allowed, size=system_prompt_len).tolist()
        for _ in range(prompts_per_group):
            question_ids = rng.choice(allowed, size=question_len).tolist()
            if return_text:
                assert tokenizer is not None  # _check_text_mode guarantees it
                text = f"{tokenizer.decode(system_ids)}\n\n{tokenizer.decode(question_ids)}"
                requests.append(BenchRequest(text, len(tokenizer.encode(text)), output_len))
            else:
                ids = system_ids + question_ids
                requests.append(BenchRequest(ids, len(ids), output_len))
    random.Random(seed).shuffle(requests)
    return requests


def _draw_lengths(rng: np.random.Generator, length: int, ratio: float, n: int) -> np.ndarray:
    low = max(int(length * ratio), 1)
    return rng.integers(low, length + 1, size=n)


def _check_text_mode(tokenizer: TokenizerLike | None, return_text: bool) -> None:
    if return_text and tokenizer is None:
        raise ValueError("text prompts need a tokenizer to decode token ids; pass --tokenizer")


def _allowed_token_ids(tokenizer: TokenizerLike | None, vocab_size: int | None) -> np.ndarray:
    """Ids random prompts may use: the vocabulary without special tokens (BOS/EOS mid-prompt
    would change what the model does, not just how long the prompt is)."""
    size = tokenizer.vocab_size if tokenizer is not None else vocab_size
    if size is None or size < 1:
        raise ValueError(
            "random token prompts need a vocabulary: pass --tokenizer, or --vocab-size "
            f"with --skip-tokenizer-init (got vocab size {size})"
        )
    special = getattr(tokenizer, "all_special_ids", None) or []
    import numpy as np

    allowed = np.setdiff1d(np.arange(size), np.asarray(special, dtype=np.int64))
    if allowed.size == 0:
        raise ValueError(f"vocabulary of {size} ids has no non-special token to sample")
    return allowed
