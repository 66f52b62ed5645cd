"""``GrammarBackendConformance``: the conformance kit of grammar backends (hook API 4).

A backend must accept exactly the strings its grammar describes (a table of grammars, strings
it must accept and strings it must refuse), its token masks must agree with a reference on
random token walks, and it must honour the interface's contract: errors are ``GrammarError``
naming the field, padded vocabulary columns are never allowed, ``copy`` is independent,
``rollback`` undoes, compiling is thread-safe, ``fill_bitmasks`` equals row-by-row fills,
``accept_tokens`` equals row-by-row ``accept_token`` and ``apply_bitmask`` equals the portable mask.

Subclass it in the plugin's tests::

    from engine.testing.grammar_kit import GrammarBackendConformance

    class TestMyBackend(GrammarBackendConformance):
        backend_name = "mine"

The mask reference is the ``regex`` package's partial matching over the token's bytes
(``engine.constrained.token_bytes``): token ``t`` is allowed after the bytes ``b`` iff
``b + bytes(t)`` can still be extended to a full match (and a stop token iff ``b`` is one). It
runs on the engine's tiny byte-level BPE tokenizer (2,048 tokens), with the logits padded past
the vocabulary as a model's often are. Every failure says which grammar, which input and what
the backend did.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from engine import plugins
from engine.constrained import (
    GrammarBackend,
    GrammarError,
    GrammarKey,
    TokenizerInfo,
    allocate_bitmask,
    allowed_tokens,
    apply_token_bitmask,
    token_bytes,
)
from engine.testing.conformance._common import KIT_SEED, derive_seed


@dataclass(frozen=True)
class GrammarCase:
    """One row of the table: a grammar, strings in its language and strings outside it."""

    name: str
    kind: str
    #: the grammar text; for ``json_schema`` a dict (serialized by the kit).
    grammar: Any
    #: strings the grammar must accept in full; for ``json_schema``, Python values serialized
    #: with the class's ``json_separators``, keys in the schema's order (a backend may keep it).
    accept: tuple[Any, ...]
    #: strings it must refuse (a token refused, or no stop token at the end).
    reject: tuple[Any, ...]


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "role": {"enum": ["admin", "user"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "age", "role"],
}

#: The table every backend must pass (kinds a backend does not declare are skipped).
CASES: tuple[GrammarCase, ...] = (
    GrammarCase("regex-digits", "regex", r"[0-9]{2,4}", ("12", "1234", "007"), ("1", "12345", "1a", "")),
    GrammarCase("regex-alternation", "regex", r"(cat|dog)s?", ("cat", "dogs", "cats"), ("cow", "catss", "dogcat")),
    GrammarCase("regex-email", "regex", r"[a-z]+@[a-z]+\.(com|org)", ("bob@mail.com", "a@b.org"),
                ("bob@mail", "@mail.com", "bob@mail.net")),
    GrammarCase("ebnf-arith", "ebnf", 'root ::= num (("+" | "*") num)*\nnum ::= [0-9]+',
                ("1", "12+3", "4*5+66"), ("+1", "1+", "1++2", "a")),
    GrammarCase("ebnf-yes-no", "ebnf", 'root ::= "yes" | "no"', ("yes", "no"), ("maybe", "yesno", "")),
    GrammarCase("json-person", "json_schema", PERSON,
                ({"name": "Ann", "age": 31, "role": "admin"},
                 {"name": "Bo", "age": 2, "tags": ["a", "b"], "role": "user", "address": {"city": "Oslo"}}),
                ({"name": "Ann", "role": "admin"},  # age is required
                 {"name": "Ann", "age": "31", "role": "admin"},  # age must be an integer
                 {"name": "Ann", "age": 31, "role": "root"},  # role outside the enum
                 {"name": "Ann", "age": 31, "role": "user", "address": {}})),  # city is required
    GrammarCase("json-array", "json_schema", {"type": "array", "items": {"type": "integer"}, "minItems": 1},
                ([1], [1, 2, 3]), ([], ["1"], {"a": 1})),
    GrammarCase("json-any-object", "json_schema", {"type": "object"},
                ({}, {"a": [1, {"b": None}], "c": "d"}), ([1], "x", 3)),
)

#: Invalid grammars: (kind, text); each must raise GrammarError naming the field.
INVALID: tuple[tuple[str, str], ...] = (
    ("regex", "a(b"),
    ("ebnf", "root ::= undefined_rule"),
    ("json_schema", '{"type": "nonsense"}'),
)


class GrammarBackendConformance:
    """Set ``backend_name``; ``json_separators`` when the backend's default JSON is not compact."""

    backend_name: ClassVar[str] = ""
    #: how the backend's JSON output separates items and keys from values with default options.
    json_separators: ClassVar[tuple[str, str]] = (",", ":")
    #: logits columns past the tokenizer's vocabulary (padded embeddings): never allowed.
    vocab_padding: ClassVar[int] = 64
    #: random walks per regex case in the mask test, and their longest length.
    walks: ClassVar[int] = 4
    walk_length: ClassVar[int] = 12
    seed: ClassVar[int] = KIT_SEED

    # -- fixtures ------------------------------------------------------------------------
    # Class-scoped fixtures are classmethods: one instance serves the whole class, and pytest
    # deprecates class-scoped fixtures defined as instance methods.
    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls) -> Any:
        import os

        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(__file__), "tiny_tokenizer"))

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls, tokenizer: Any) -> GrammarBackend:
        spec = plugins.get_grammar_backend(cls.backend_name)
        info = TokenizerInfo(tokenizer, len(tokenizer) + cls.vocab_padding, (tokenizer.eos_token_id,), "tiny")
        backend = plugins.create_grammar_backend(cls.backend_name, info)
        assert isinstance(backend, GrammarBackend), (
            f"{spec.factory} returned {type(backend).__name__}; it must return an engine.constrained.GrammarBackend")
        return backend

    # -- helpers -------------------------------------------------------------------------
    def _kinds(self) -> tuple[str, ...]:
        return plugins.get_grammar_backend(self.backend_name).grammar_kinds

    def _key(self, case: GrammarCase) -> GrammarKey:
        text = case.grammar if isinstance(case.grammar, str) else json.dumps(case.grammar)
        return GrammarKey(case.kind, text)

    def _text(self, case: GrammarCase, value: Any) -> str:
        if case.kind == "json_schema":
            return json.dumps(value, separators=self.json_separators)
        return str(value)

    @staticmethod
    def _accepts(backend: GrammarBackend, compiled: Any, tokenizer: Any, text: str) -> bool:
        matcher = backend.matcher(compiled)
        for token in tokenizer.encode(text, add_special_tokens=False):
            if not matcher.accept_token(token):
                return False
        return matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()

    def _skip_unless(self, kind: str) -> None:
        if kind not in self._kinds():
            pytest.skip(f"{self.backend_name} does not declare grammar kind '{kind}'")

    # -- the table -----------------------------------------------------------------------
    @pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
    def test_accepts_exactly_its_language(self, case: GrammarCase, backend: GrammarBackend, tokenizer: Any) -> None:
        self._skip_unless(case.kind)
        compiled = backend.compile(self._key(case))
        for value in case.accept:
            text = self._text(case, value)
            assert self._accepts(backend, compiled, tokenizer, text), f"{case.name}: refused {text!r}, which is in the language"
        for value in case.reject:
            text = self._text(case, value)
            assert not self._accepts(backend, compiled, tokenizer, text), f"{case.name}: accepted {text!r}, which is not"

    @pytest.mark.parametrize("case", [c for c in CASES if c.kind == "regex"], ids=lambda c: c.name)
    def test_masks_agree_with_reference(self, case: GrammarCase, backend: GrammarBackend, tokenizer: Any) -> None:
        """Random walks through the grammar: at each step the backend's mask equals the set of
        tokens whose bytes keep a partial regex match alive (plus EOS on a full match)."""
        import regex

        pattern = regex.compile(case.grammar.encode())
        table = _token_bytes(tokenizer)
        eos = tokenizer.eos_token_id
        vocab = len(tokenizer) + self.vocab_padding
        compiled = backend.compile(self._key(case))
        rng = random.Random(derive_seed(self.seed, case.name))
        bitmask = allocate_bitmask(1, vocab)
        for walk in range(self.walks):
            matcher = backend.matcher(compiled)
            prefix = b""
            for step in range(self.walk_length):
                bitmask.fill_(0)
                matcher.fill_bitmask(bitmask, 0)
                got = set(allowed_tokens(bitmask[0], vocab))
                want = {t for t, b in table.items()
                        if b and pattern.fullmatch(prefix + b, partial=True) is not None}
                if pattern.fullmatch(prefix) is not None:
                    want.add(eos)
                assert got == want, (f"{case.name} walk {walk} step {step} after {prefix!r}: backend allows "
                                     f"{sorted(got - want)[:8]} the reference refuses, refuses {sorted(want - got)[:8]}")
                choice = rng.choice(sorted(want))
                assert matcher.accept_token(choice), (
                    f"{case.name} walk {walk} step {step} after {prefix!r}: accept_token({choice}) refused a token "
                    "its own mask allows")
                if choice == eos:
                    assert matcher.is_terminated(), (
                        f"{case.name} after {prefix!r}: the stop token was accepted but is_terminated() is False")
                    break
                prefix += table[choice]

    # -- the contract --------------------------------------------------------------------
    @pytest.mark.parametrize("kind,text", INVALID, ids=[k for k, _ in INVALID])
    def test_invalid_grammar_is_a_grammar_error_naming_the_field(self, kind: str, text: str,
                                                                 backend: GrammarBackend) -> None:
        self._skip_unless(kind)
        for check in (backend.validate, backend.compile):
            try:
                check(GrammarKey(kind, text))
            except GrammarError as exc:
                assert exc.field == kind and kind in str(exc), (
                    f"{check.__name__}() of the invalid {kind} grammar {text!r}: the GrammarError must name the "
                    f"field {kind!r} (field={exc.field!r}, message {str(exc)!r})")
            else:
                pytest.fail(f"{check.__name__}() accepted the invalid {kind} grammar {text!r}; "
                            "it must raise engine.constrained.GrammarError")

    def test_valid_grammars_validate(self, backend: GrammarBackend) -> None:
        for case in CASES:
            if case.kind in self._kinds():
                try:
                    backend.validate(self._key(case))
                except GrammarError as exc:
                    pytest.fail(f"{case.name}: validate() refused a valid {case.kind} grammar: {exc}")

    @pytest.mark.parametrize("text", ['', '{', '{"name"', '{"name": "Ann"', '{"name": "Ann", "age": 3',
                                      '{"name": "Ann", "age": 31, "role": "admin"',
                                      '{"name": "Ann", "age": 31, "tags": ["a"'])
    def test_end_of_text_is_refused_inside_an_unfinished_json_document(self, text: str, backend: GrammarBackend,
                                                                        tokenizer: Any) -> None:
        """Until the JSON document is complete the stop token is neither in the mask nor
        accepted: a request must not end on half an object. Once the document closes, it is."""
        self._skip_unless("json_schema")
        vocab = len(tokenizer) + self.vocab_padding
        eos = tokenizer.eos_token_id
        compiled = backend.compile(GrammarKey("json_schema", json.dumps(PERSON)))
        matcher = backend.matcher(compiled)
        text = text.replace(": ", self.json_separators[1]).replace(", ", self.json_separators[0])
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept_token(token), (
                f"refused token {token} ({tokenizer.decode([token])!r}) of the valid JSON prefix {text!r}")
        bitmask = allocate_bitmask(1, vocab)
        matcher.fill_bitmask(bitmask, 0)
        assert eos not in set(allowed_tokens(bitmask[0], vocab)), (
            f"the mask allows the stop token after the unfinished JSON document {text!r}")
        assert not matcher.accept_token(eos), f"accepted the stop token after the unfinished JSON document {text!r}"
        assert not matcher.is_terminated(), f"terminated inside the unfinished JSON document {text!r}"
        # Complete the document: now the stop token ends it.
        whole = json.dumps({"name": "Ann", "age": 31, "role": "admin"}, separators=self.json_separators)
        done = backend.matcher(compiled)
        for token in tokenizer.encode(whole, add_special_tokens=False):
            assert done.accept_token(token), f"refused a token of the complete document {whole!r}"
        done.fill_bitmask(bitmask, 0)
        assert eos in set(allowed_tokens(bitmask[0], vocab)), f"the mask refuses the stop token after {whole!r}"
        assert done.accept_token(eos) and done.is_terminated(), f"the stop token did not end {whole!r}"

    def test_padded_columns_and_special_tokens_are_never_allowed(self, backend: GrammarBackend, tokenizer: Any) -> None:
        self._skip_unless("json_schema")
        vocab = len(tokenizer) + self.vocab_padding
        compiled = backend.compile(GrammarKey("json_schema", json.dumps({"type": "object"})))
        bitmask = allocate_bitmask(2, vocab)
        bitmask.fill_(-1)
        backend.matcher(compiled).fill_bitmask(bitmask, 1)
        allowed = set(allowed_tokens(bitmask[1], vocab))
        assert allowed and not allowed & set(range(len(tokenizer), vocab)), "padded vocabulary columns allowed"
        assert not allowed & set(tokenizer.all_special_ids), "special tokens allowed inside JSON"
        assert bitmask[0].eq(-1).all(), "fill_bitmask wrote outside its row"

    def test_copy_is_independent(self, backend: GrammarBackend, tokenizer: Any) -> None:
        self._skip_unless("regex")
        compiled = backend.compile(GrammarKey("regex", "(ab|cd)+"))
        first = backend.matcher(compiled)
        assert all(first.accept_token(t) for t in tokenizer.encode("ab", add_special_tokens=False)), (
            "regex (ab|cd)+ refused 'ab'")
        twin = first.copy()
        text = tokenizer.encode("cd", add_special_tokens=False)
        assert all(twin.accept_token(t) for t in text), "the copy of a matcher at 'ab' refused 'cd'"
        assert twin.accept_token(tokenizer.eos_token_id) and twin.is_terminated(), (
            "the copy did not end on the stop token after 'abcd'")
        assert not first.is_terminated(), "accepting on a copy changed the original"
        assert first.accept_token(tokenizer.eos_token_id) and first.is_terminated(), (
            "the original, still at 'ab', did not end on the stop token")

    def test_rollback_undoes_tokens(self, backend: GrammarBackend, tokenizer: Any) -> None:
        spec = plugins.get_grammar_backend(self.backend_name)
        if not spec.supports_rollback:
            pytest.skip(f"{self.backend_name} does not declare supports_rollback")
        self._skip_unless("regex")
        vocab = len(tokenizer) + self.vocab_padding
        matcher = backend.matcher(backend.compile(GrammarKey("regex", "[a-z]+[0-9]")))
        before, after = allocate_bitmask(1, vocab), allocate_bitmask(1, vocab)
        matcher.fill_bitmask(before, 0)
        tokens = tokenizer.encode("abc1", add_special_tokens=False)
        assert all(matcher.accept_token(t) for t in tokens), "regex [a-z]+[0-9] refused 'abc1'"
        assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated(), (
            "the stop token did not end 'abc1'")
        matcher.rollback(len(tokens) + 1)
        assert not matcher.is_terminated(), f"still terminated after rollback({len(tokens) + 1})"
        matcher.fill_bitmask(after, 0)
        assert torch.equal(before, after), "rollback did not restore the start state"

    def test_refused_token_leaves_the_state_unchanged(self, backend: GrammarBackend, tokenizer: Any) -> None:
        self._skip_unless("regex")
        matcher = backend.matcher(backend.compile(GrammarKey("regex", "[0-9]+")))
        assert not matcher.accept_token(tokenizer.encode("x", add_special_tokens=False)[0]), (
            "regex [0-9]+ accepted 'x'")
        assert all(matcher.accept_token(t) for t in tokenizer.encode("42", add_special_tokens=False)), (
            "after refusing 'x', regex [0-9]+ refused '42': a refused token changed the state")
        assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated(), (
            "the stop token did not end '42'")

    def test_compiles_concurrently(self, backend: GrammarBackend, tokenizer: Any) -> None:
        """The engine compiles on a thread pool: concurrent compiles give working grammars."""
        self._skip_unless("regex")
        results: dict[int, bool] = {}

        def work(i: int) -> None:
            compiled = backend.compile(GrammarKey("regex", f"id{i}-[a-z]{{{i % 3 + 1}}}"))
            results[i] = self._accepts(backend, compiled, tokenizer, f"id{i}-" + "q" * (i % 3 + 1))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {i: True for i in range(6)}, (
            f"grammars compiled on 6 threads at once: accepted their string {results} (want all True)")

    def test_batch_fill_equals_row_by_row(self, backend: GrammarBackend, tokenizer: Any) -> None:
        """``fill_bitmasks`` over a batch of matchers in different states (some rows left out)
        writes what each matcher's own ``fill_bitmask`` writes, and nothing else."""
        self._skip_unless("regex")
        vocab = len(tokenizer) + self.vocab_padding
        compiled = backend.compile(GrammarKey("regex", "[a-z]{1,6}[0-9]{1,3}"))
        matchers = []
        for i in range(12):
            matcher = backend.matcher(compiled)
            for token in tokenizer.encode("abcdef12"[: i % 8], add_special_tokens=False):
                assert matcher.accept_token(token), f"regex [a-z]{{1,6}}[0-9]{{1,3}} refused {'abcdef12'[: i % 8]!r}"
            matchers.append(matcher)
        rows = [r for r in range(16) if r % 4 != 1][: len(matchers)]
        batch = allocate_bitmask(16, vocab)
        backend.fill_bitmasks(matchers, batch, rows)
        want = allocate_bitmask(16, vocab)
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(want, row)
        assert torch.equal(batch, want), (
            f"fill_bitmasks over rows {rows} differs from each matcher's fill_bitmask (rows differing: "
            f"{[r for r in range(16) if not torch.equal(batch[r], want[r])]})")

    def test_fill_overwrites_whole_rows(self, backend: GrammarBackend, tokenizer: Any) -> None:
        """A fill writes every word of its rows, whatever the buffer held: the scheduler reuses
        one host buffer and does not clear the rows a matcher fills (clearing 1 MB per step in
        torch cost milliseconds under thread contention). Single-row and batch fills alike."""
        self._skip_unless("regex")
        vocab = len(tokenizer) + self.vocab_padding
        compiled = backend.compile(GrammarKey("regex", "[a-z]{1,6}[0-9]{1,3}"))
        matchers = [backend.matcher(compiled) for _ in range(3)]
        for i, matcher in enumerate(matchers):
            for token in tokenizer.encode("abc12"[: 2 * i], add_special_tokens=False):
                assert matcher.accept_token(token), f"regex [a-z]{{1,6}}[0-9]{{1,3}} refused {'abc12'[: 2 * i]!r}"
        rng = torch.Generator().manual_seed(derive_seed(self.seed, "dirty"))
        for batch in (False, True):
            clean = allocate_bitmask(3, vocab)
            dirty = allocate_bitmask(3, vocab)
            dirty.copy_(torch.randint(-(2**31), 2**31 - 1, dirty.shape, generator=rng, dtype=torch.int32))
            for buf in (clean, dirty):
                if batch:
                    backend.fill_bitmasks(matchers, buf, [0, 1, 2])
                else:
                    for row, matcher in enumerate(matchers):
                        matcher.fill_bitmask(buf, row)
            assert torch.equal(clean, dirty), f"{'batch' if batch else 'row'} fill left bits of the old contents"

    def test_batch_accept_equals_row_by_row(self, backend: GrammarBackend, tokenizer: Any) -> None:
        """``accept_tokens`` over a batch (rows in different states; tokens the grammar accepts,
        refuses, stop tokens, tokens after the end) gives what each matcher's own ``accept_token``
        gives, and leaves every matcher where ``accept_token`` leaves its twin."""
        self._skip_unless("regex")
        vocab = len(tokenizer) + self.vocab_padding
        compiled = backend.compile(GrammarKey("regex", "[a-z]{1,6}[0-9]{1,3}"))
        rng = random.Random(derive_seed(self.seed, "batch-accept"))
        # 40 rows: enough for a backend that splits a batch over threads to do so.
        texts = ["".join(rng.choice("abz09-") for _ in range(rng.randint(1, 9))) for _ in range(40)]
        texts[:3] = ["abc12", "abc12", "1a"]  # a complete match; the same again; refused at once
        sequences = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        batch = [backend.matcher(compiled) for _ in texts]
        twins = [backend.matcher(compiled) for _ in texts]
        refused = 0
        for step in range(max(map(len, sequences)) + 2):
            # Past its text each row takes the stop token, then again (after the end).
            tokens = [seq[step] if step < len(seq) else tokenizer.eos_token_id for seq in sequences]
            got = backend.accept_tokens(batch, tokens)
            want = [twin.accept_token(token) for twin, token in zip(twins, tokens)]
            assert [bool(g) for g in got] == want, f"step {step}: batch {got} vs row by row {want}"
            refused += want.count(False)
            assert [m.is_terminated() for m in batch] == [m.is_terminated() for m in twins], (
                f"step {step}: is_terminated() after the batch accept differs from row by row")
            masks, twin_masks = allocate_bitmask(len(texts), vocab), allocate_bitmask(len(texts), vocab)
            for row, (matcher, twin) in enumerate(zip(batch, twins)):
                if not matcher.is_terminated():
                    matcher.fill_bitmask(masks, row)
                    twin.fill_bitmask(twin_masks, row)
            assert torch.equal(masks, twin_masks), f"step {step}: states differ after the batch accept"
        assert refused and any(m.is_terminated() for m in twins), "the sequence must refuse and finish"
        assert backend.accept_tokens([], []) == [], "accept_tokens of an empty batch must return []"

    def test_apply_bitmask_matches_the_portable_mask(self, backend: GrammarBackend, tokenizer: Any) -> None:
        vocab = len(tokenizer) + self.vocab_padding
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "apply"))
        bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=gen, dtype=torch.int64)
        bitmask = bitmask.to(torch.int32)
        # Logits wider than the bitmask covers (a model padded further): those columns end -inf.
        logits = torch.randn(3, vocab + 32, generator=gen)
        want = logits.clone()
        apply_token_bitmask(want, bitmask)
        backend.apply_bitmask(logits, bitmask)
        assert torch.equal(torch.isinf(logits), torch.isinf(want)), (
            f"apply_bitmask masked {int(torch.isinf(logits).sum())} logits, the portable mask "
            f"{int(torch.isinf(want).sum())} (or other ones)")
        assert torch.equal(logits[~torch.isinf(want)], want[~torch.isinf(want)]), (
            "apply_bitmask changed logits the bitmask allows")


def _token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Each ordinary token's bytes (special tokens are left out: no grammar of the table allows them)."""
    return {t: b for t, b in enumerate(token_bytes(tokenizer)) if b is not None}
