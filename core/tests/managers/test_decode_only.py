"""The detokenizer's decode-only tokenizer: the tokenizers library's object where it decodes alike."""

from __future__ import annotations

import pickle
import subprocess
import sys
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from engine.managers.decode_only import BackendDecoder, decoding_tokenizer


def _byte_level_bpe() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["Ġt"] = len(vocab)
    vocab["he"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t"), ("h", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _backend(**kwargs: Any) -> TokenizersBackend:
    return TokenizersBackend(tokenizer_object=_byte_level_bpe(), eos_token="<|end|>", **kwargs)


def test_a_tokenizers_backend_is_sent_as_its_rust_tokenizer_and_decodes_alike() -> None:
    tokenizer = _backend()
    decoder = decoding_tokenizer(tokenizer)
    assert isinstance(decoder, BackendDecoder)
    text = "the théâtre, 東京 <|end|> then"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = pickle.loads(pickle.dumps(decoder))
    for skip in (False, True):
        for part in (ids, ids[:3], ids[3:7], ids[-1]):
            assert decoder.decode(part, skip_special_tokens=skip, spaces_between_special_tokens=False) == \
                tokenizer.decode(part, skip_special_tokens=skip)


def test_a_class_with_its_own_decode_or_a_clean_up_pass_is_sent_whole() -> None:
    class OwnDecode(TokenizersBackend):
        def _decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    own = OwnDecode(tokenizer_object=_byte_level_bpe())
    assert decoding_tokenizer(own) is own
    forced = _backend(clean_up_tokenization_spaces=True,
                      clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    assert decoding_tokenizer(forced) is forced
    assert decoding_tokenizer(None) is None


def test_the_decoder_unpickles_without_transformers() -> None:
    blob = pickle.dumps(decoding_tokenizer(_backend()))
    code = ("import pickle, sys; d = pickle.loads(sys.stdin.buffer.read()); "
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules; print(d.decode([70, 71]))")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == _backend().decode([70, 71])
