"""Incremental detokenization must reproduce the full decode; stop strings must never leak."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.managers.incremental_detokenizer import IncrementalDetokenizer, StopStringMatcher

CORPUS = [
    "你好世界 🎉🚀 héllo",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and\ttabs\nnew lines",
    "naïve café résumé 日本語のテキスト",
    "emoji 😀😃😄 👨‍👩‍👧 and flags 🇫🇷",
] * 4

TRICKY = [
    "你好世界 🎉🚀 héllo",
    " leading space",
    "   three leading spaces",
    "🦀🦀 unseen crab, ☃ snowman, 𝄞 clef",
    "混合 mixed テキスト 🇯🇵 ok",
    "ends with emoji 👨‍👩‍👧",
    "tabs\tand\nnewlines\n\n",
    "a",
    "▁literal metaspace char",
]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def metaspace_tokenizer(llama_decoder: bool) -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE with byte fallback: unseen characters become <0xXX> tokens."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    trained.train_from_iterator(CORPUS, trainer)
    model = json.loads(trained.to_str())["model"]
    # The byte tokens must be ordinary vocabulary (as in Llama), not special tokens, or
    # skip_special_tokens would drop them; so the model is rebuilt with them added.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    if llama_decoder:
        # Llama 2's decoder: the leading space is removed by Strip after all tokens are fused.
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    else:
        metaspace = decoders.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), metaspace])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    assert len(fast.encode("🦀", add_special_tokens=False)) > 1  # byte fallback in use
    return fast


FACTORIES = {
    "byte_level": byte_level_tokenizer,
    "metaspace": lambda: metaspace_tokenizer(llama_decoder=False),
    "llama_style": lambda: metaspace_tokenizer(llama_decoder=True),
}


@pytest.fixture(scope="module", params=list(FACTORIES))
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    tok = FACTORIES[request.param]()
    tok.add_tokens(["<tool>"])  # an added, non-special token
    return tok


def random_text(rng: random.Random) -> str:
    pools = [
        "abcdefghij klmnop ",
        "  \n\t.,!?",
        "éèàüñç",
        "".join(chr(c) for c in range(0x4E00, 0x4E40)),
        "".join(chr(c) for c in range(0x1F600, 0x1F640)),
        "你好世界🎉🚀",
    ]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40)))


def chunks(ids: list[int], rng: random.Random | None) -> Iterator[list[int]]:
    """One token at a time, or random chunk sizes when given a generator."""
    i = 0
    while i < len(ids):
        size = rng.randint(1, 4) if rng else 1
        yield ids[i : i + size]
        i += size


def detokenize(
    tok: PreTrainedTokenizerFast, ids: list[int], rng: random.Random | None, **kw: bool
) -> list[str]:
    det = IncrementalDetokenizer(tok, **kw)
    pieces = [det.add_tokens(chunk) for chunk in chunks(ids, rng)]
    pieces.append(det.flush())
    assert det.output_ids == ids
    assert det.output_text == "".join(pieces)
    return pieces


def with_specials(tok: PreTrainedTokenizerFast, text: str, rng: random.Random) -> list[int]:
    """Token ids of ``text`` with special and added tokens between characters."""
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 3))))
    specials = [tok.bos_token_id, tok.eos_token_id, tok.convert_tokens_to_ids("<tool>")]
    ids: list[int] = []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        ids += tok.encode(text[start:end], add_special_tokens=False)
        if end < len(text) or rng.random() < 0.5:
            ids.append(rng.choice(specials))
    return ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("chunked", [False, True], ids=["one_by_one", "chunked"])
def test_matches_full_decode(
    tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool, chunked: bool
) -> None:
    rng = random.Random(1234)
    texts = TRICKY + [random_text(rng) for _ in range(150)]
    for n, text in enumerate(texts):
        if n % 3 == 0:
            ids = with_specials(tokenizer, text, rng)
        else:
            ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = detokenize(
            tokenizer, ids, rng if chunked else None, skip_special_tokens=skip_special_tokens
        )
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == full, (text, ids, pieces)
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in pieces), (text, pieces)


def test_random_ids_match_byte_level_decode() -> None:
    # Arbitrary ids include invalid UTF-8; byte-level decoding replaces it locally, so the
    # incremental text still equals the full decode.
    tok = byte_level_tokenizer()
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        assert "".join(detokenize(tok, ids, rng)) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("prompt", ["Hello there", "你好", "The fox🎉", "a b c d e f g h"])
@pytest.mark.parametrize("output", [" world", "世界 🚀", " 🦀 crab", "  two spaces"])
def test_decodes_in_prompt_context(
    tokenizer: PreTrainedTokenizerFast, prompt: str, output: str
) -> None:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    # Tokenized after the prompt, as a model would produce it: a leading space belongs to the
    # first output token ("▁world" / "Ġworld"); SentencePiece decoders drop it at text start.
    all_ids = tokenizer.encode(prompt + output, add_special_tokens=False)
    if all_ids[: len(prompt_ids)] != prompt_ids:  # BPE merged across the boundary
        all_ids = prompt_ids + tokenizer.encode(output, add_special_tokens=False)
    output_ids = all_ids[len(prompt_ids) :]
    full, prompt_text = tokenizer.decode(all_ids), tokenizer.decode(prompt_ids)
    assert full.startswith(prompt_text)
    expected = full[len(prompt_text) :]
    if tokenizer.encode(prompt + output, add_special_tokens=False) == all_ids:
        assert expected == output
    # Skipped special tokens around the prompt, more of them than the initial context window,
    # must not make the decoder treat the first output token as the start of the text.
    bos, eos = [tokenizer.bos_token_id], [tokenizer.eos_token_id]
    for context in (prompt_ids, bos + prompt_ids, bos + prompt_ids + eos * 7):
        det = IncrementalDetokenizer(tokenizer, prompt_ids=context)
        text = "".join(det.add_tokens([t]) for t in output_ids) + det.flush()
        assert text == expected, (prompt, output, context)


def reference_cut(text: str, stops: list[str], include_stop: bool) -> str:
    """The text up to the first stop string to complete (longest one on ties)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            longest = max(done, key=len)
            return text[:end] if include_stop else text[: end - len(longest)]
    return text


def stream_with_stops(
    tok: PreTrainedTokenizerFast, ids: list[int], matcher: StopStringMatcher, rng: random.Random
) -> tuple[str, list[str]]:
    """The detokenizer process loop: returns (final text, streamed pieces)."""
    det = IncrementalDetokenizer(tok)
    sent, streamed = 0, []
    for chunk in [*chunks(ids, rng), None]:
        before = len(det.output_text)
        det.add_tokens(chunk) if chunk is not None else det.flush()
        text = det.output_text
        matched, cut = matcher.feed(text, before)
        if matched:
            assert sent <= cut, "streamed text that is part of a stop string"
            streamed.append(text[sent:cut])
            return text[:cut], streamed
        safe = len(text) - matcher.holdback(text) if chunk is not None else len(text)
        assert safe >= sent
        streamed.append(text[sent:safe])
        sent = safe
    return det.output_text, streamed


STOP_CASES = [
    ("The quick brown fox jumps over the lazy dog.", ["brown fox"]),
    ("The quick brown fox jumps over the lazy dog.", ["lazy", "quick"]),
    ("The quick brown fox jumps over the lazy dog.", ["ox jumps o", "x j"]),
    ("你好世界 🎉🚀 héllo", ["🎉🚀 h"]),
    ("你好世界 🎉🚀 héllo", ["界", "好世"]),
    ("abababc", ["ababc", "abd"]),
    ("no stop here at all", ["stop!", "zzz"]),
    ("repeat repeat repeat", ["eat r", "peat"]),
]


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("text,stops", STOP_CASES)
def test_stop_strings(
    tokenizer: PreTrainedTokenizerFast, text: str, stops: list[str], include_stop: bool
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = reference_cut(tokenizer.decode(ids), stops, include_stop)
    for seed in range(5):
        matcher = StopStringMatcher(stops, include_stop=include_stop)
        final, streamed = stream_with_stops(tokenizer, ids, matcher, random.Random(seed))
        assert final == expected
        assert "".join(streamed) == final


def test_holdback_and_feed_edges() -> None:
    matcher = StopStringMatcher(["</end>", "##"])
    assert matcher.holdback("text </en") == 4
    assert matcher.holdback("text #") == 1
    assert matcher.holdback("text <") == 1
    assert matcher.holdback("plain") == 0
    assert matcher.feed("a </end> b", 0) == (True, 2) and matcher.matched == "</end>"
    assert matcher.feed("x ##</end>", 2) == (True, 2) and matcher.matched == "##"
    assert matcher.feed("a </en", 0) == (False, 6)
    assert StopStringMatcher(["</end>"], include_stop=True).feed("a </end> b", 3) == (True, 8)
    assert StopStringMatcher([]).holdback("anything") == 0
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])
