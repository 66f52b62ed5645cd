"""Tests for engine.bench.datasets: lengths, range ratio, seeding, the ShareGPT filter."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.bench.datasets import (
    BenchRequest,
    DatasetArgs,
    sample_generated_shared_prefix_requests,
    sample_random_requests,
    sample_requests,
)
from engine.bench.sharegpt import sample_sharegpt_requests


def _random(**overrides: Any) -> list[BenchRequest]:
    kwargs: dict[str, Any] = dict(
        num_prompts=200, input_len=40, output_len=20, range_ratio=0.5, seed=0, vocab_size=50
    )
    kwargs.update(overrides)
    return sample_random_requests(**kwargs)


def test_random_lengths_stay_in_range_ratio_bounds() -> None:
    requests = _random()
    assert len(requests) == 200
    assert all(20 <= r.prompt_len <= 40 for r in requests)
    assert all(10 <= r.output_len <= 20 for r in requests)
    # Uniform draws over 21 values should hit both ends in 200 tries.
    assert {min(r.prompt_len for r in requests), max(r.prompt_len for r in requests)} == {20, 40}
    for r in requests:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert all(0 <= t < 50 for t in r.prompt)


def test_random_ratio_one_gives_exact_lengths_and_zero_keeps_at_least_one() -> None:
    exact = _random(range_ratio=1.0)
    assert {(r.prompt_len, r.output_len) for r in exact} == {(40, 20)}
    loose = _random(range_ratio=0.0, num_prompts=500)
    assert min(r.prompt_len for r in loose) >= 1 and min(r.output_len for r in loose) >= 1


def test_random_is_seeded() -> None:
    assert _random(seed=3) == _random(seed=3)
    assert _random(seed=3) != _random(seed=4)


def test_random_skips_special_tokens_and_decodes_text(word_tokenizer: Any) -> None:
    ids = _random(vocab_size=None, tokenizer=word_tokenizer, range_ratio=1.0)
    assert all(0 not in r.prompt for r in ids)
    texts = _random(vocab_size=None, tokenizer=word_tokenizer, range_ratio=1.0, return_text=True)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 40 for r in texts)


def test_random_errors_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--vocab-size"):
        _random(vocab_size=None)
    with pytest.raises(ValueError, match="--tokenizer"):
        _random(return_text=True)
    with pytest.raises(ValueError, match="--random-range-ratio"):
        _random(range_ratio=1.5)


def _conv(prompt_words: int, reply_words: int, tag: int = 0) -> dict[str, Any]:
    # Tag the first word so each kept conversation is identifiable after shuffling.
    prompt = " ".join([f"w{tag}"] + ["w5"] * (prompt_words - 1))
    reply = " ".join(["w6"] * reply_words)
    return {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}


@pytest.fixture
def sharegpt_file(tmp_path: Path) -> Path:
    gpt_only = [{"from": "gpt", "value": "w1 w2 w3 w4"}] * 2
    records = [
        _conv(10, 10, tag=11),  # kept
        _conv(4, 4, tag=12),  # kept: exactly at the minimum
        _conv(3, 50, tag=13),  # prompt too short
        _conv(50, 3, tag=14),  # reply too short
        _conv(1025, 10, tag=15),  # prompt over 1024
        _conv(1000, 1100, tag=16),  # pair over 2048
        _conv(20, 30, tag=17),  # kept
        {"conversations": [{"from": "human", "value": "w1 w2 w3 w4 w5"}]},  # no reply
        {"conversations": gpt_only},  # no human turn
        {"id": "no conversations at all"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    return path


@pytest.fixture
def sharegpt(sharegpt_file: Path, word_tokenizer: Any) -> Callable[..., list[BenchRequest]]:
    """``sample_sharegpt_requests`` on the fixture file, 100 prompts, seed 0 unless overridden."""

    def sample(**overrides: Any) -> list[BenchRequest]:
        kwargs: dict[str, Any] = dict(
            dataset_path=str(sharegpt_file), num_prompts=100, tokenizer=word_tokenizer, seed=0
        )
        kwargs.update(overrides)
        return sample_sharegpt_requests(**kwargs)

    return sample


def _tags(requests: list[BenchRequest]) -> set[int]:
    return {int(str(r.prompt).split()[0][1:]) for r in requests}


def test_sharegpt_filter_matches_sglang(sharegpt: Callable[..., list[BenchRequest]]) -> None:
    requests = sharegpt()
    assert _tags(requests) == {11, 12, 17}
    by_tag = {int(str(r.prompt).split()[0][1:]): r for r in requests}
    assert (by_tag[17].prompt_len, by_tag[17].output_len) == (20, 30)


def test_sharegpt_context_len_replaces_fixed_limits(
    sharegpt: Callable[..., list[BenchRequest]],
) -> None:
    assert _tags(sharegpt(context_len=2100)) == {11, 12, 15, 16, 17}
    assert _tags(sharegpt(context_len=30)) == {11, 12}


def test_sharegpt_output_override_cap_and_seeded_shuffle(
    sharegpt: Callable[..., list[BenchRequest]],
) -> None:
    fixed = sharegpt(fixed_output_len=8)
    # The override also rescues pairs whose real reply was too short or too long.
    assert _tags(fixed) == {11, 12, 14, 16, 17} and {r.output_len for r in fixed} == {8}
    orders = {seed: [r.prompt for r in sharegpt(seed=seed)] for seed in range(6)}
    assert orders[0] == [r.prompt for r in sharegpt(seed=0)]
    assert len({tuple(o) for o in orders.values()}) > 1
    assert len(sharegpt(num_prompts=2)) == 2
    ids = sharegpt(return_text=False)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len for r in ids)
    with pytest.raises(ValueError, match="--sharegpt-output-len"):
        sharegpt(fixed_output_len=3)


def test_sharegpt_missing_file_is_a_clear_error(
    sharegpt: Callable[..., list[BenchRequest]], tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError, match="--dataset-path"):
        sharegpt(dataset_path=str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="--dataset-path"):
        sharegpt(dataset_path=None)


def test_generated_shared_prefix_groups_share_exact_prefixes() -> None:
    kwargs: dict[str, Any] = dict(
        num_groups=3, prompts_per_group=5, system_prompt_len=30, question_len=7, output_len=9,
        seed=1, vocab_size=1000,
    )  # fmt: skip
    requests = sample_generated_shared_prefix_requests(**kwargs)
    assert len(requests) == 15
    assert {(r.prompt_len, r.output_len) for r in requests} == {(37, 9)}
    prefixes = Counter(tuple(r.prompt[:30]) for r in requests)
    assert sorted(prefixes.values()) == [5, 5, 5]
    # Shuffled: the first five are not all one group.
    assert len({tuple(r.prompt[:30]) for r in requests[:5]}) > 1
    assert requests == sample_generated_shared_prefix_requests(**kwargs)


def test_generated_shared_prefix_text_mode(word_tokenizer: Any) -> None:
    requests = sample_generated_shared_prefix_requests(
        2, 2, 10, 3, 4, seed=0, tokenizer=word_tokenizer, return_text=True
    )
    assert all(isinstance(r.prompt, str) and r.prompt_len == 13 for r in requests)


def test_sample_requests_dispatch_and_unknown_names(
    sharegpt_file: Path, word_tokenizer: Any
) -> None:
    args = DatasetArgs(num_prompts=5, random_input_len=8, random_output_len=4, vocab_size=20)
    assert len(sample_requests(args, None, return_text=False)) == 5
    args = DatasetArgs(dataset_name="sharegpt-file", dataset_path=str(sharegpt_file))
    assert len(sample_requests(args, word_tokenizer, return_text=True)) == 3
    with pytest.raises(ValueError, match="needs a tokenizer"):
        sample_requests(args, None, return_text=False)
    args = DatasetArgs(
        dataset_name="generated-shared-prefix", gsp_num_groups=2, gsp_prompts_per_group=3,
        gsp_system_prompt_len=5, gsp_question_len=2, gsp_output_len=3, vocab_size=20,
    )  # fmt: skip
    assert len(sample_requests(args, None, return_text=False)) == 6
    with pytest.raises(ValueError, match="sharegpt-file.*--dataset-path"):
        sample_requests(DatasetArgs(dataset_name="sharegpt"), None, return_text=False)
    accepted = "accepted: random, sharegpt-file, generated-shared-prefix"
    with pytest.raises(ValueError, match=accepted):
        sample_requests(DatasetArgs(dataset_name="mmlu"), None, return_text=False)


def test_works_with_a_hugging_face_tokenizer(sharegpt: Callable[..., list[BenchRequest]]) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "<s>": 1, **{f"w{i}": i + 2 for i in range(40)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>"
    )
    requests = _random(vocab_size=None, tokenizer=hf, return_text=True, num_prompts=20)
    assert all(isinstance(r.prompt, str) for r in requests)
    assert not any("<s>" in r.prompt or "[UNK]" in r.prompt for r in requests)
    assert len(sharegpt(tokenizer=hf)) == 3
