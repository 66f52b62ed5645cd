"""Scanning model output that is still being generated: JSON values, call objects and tags.

Parsers re-read the whole output after every streamed piece, so each function here answers
for a prefix of the final text: a value that has not ended yet is ``None`` (incomplete), not
an error, unless ``final`` says no more text will come. Nothing here validates JSON deeply:
``json.loads`` does that once a value is complete.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\r\n"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_LITERAL = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_PARTIAL_NUMBER = re.compile(r"-?\d*(?:\.\d*)?(?:[eE][+-]?\d*)?")
# What may follow a number or literal (anything else means it is not over, or is malformed).
_AFTER_LITERAL = _WS + ",}]:"
# The characters that change a container's depth or start a string.
_STRUCTURE = re.compile(r'[\[\]{}"]')


class MalformedJSON(ValueError):
    """The text cannot be (the start of) a JSON value at this position."""


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is the start of ``tag`` (but not all of it):
    characters a stream holds back because they may yet become the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_string(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at ``text[i] == '"'``; None if unterminated."""
    m = _STRING.match(text, i)
    return m.end() if m else None


def scan_value(text: str, i: int, final: bool) -> int | None:
    """End (exclusive) of the JSON value starting at ``i``; None while it is incomplete.

    Raises MalformedJSON when no JSON value can start there.
    """
    n = len(text)
    c = text[i]
    if c == '"':
        return scan_string(text, i)
    if c in "{[":
        depth, j = 0, i
        while True:
            m = _STRUCTURE.search(text, j)
            if m is None:
                return None
            j = m.start()
            ch = text[j]
            if ch == '"':
                end = scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if ch in "{[" else -1
            j += 1
            if depth == 0:
                return j
    m = _LITERAL.match(text, i)
    if m is not None and ((m.end() < n and text[m.end()] in _AFTER_LITERAL) or (m.end() == n and final)):
        return m.end()
    rest = text[i:]
    if not final and (any(word.startswith(rest) for word in ("true", "false", "null"))
                      or _PARTIAL_NUMBER.fullmatch(rest)):
        return None  # a literal or number still being written
    raise MalformedJSON(f"no JSON value starts with {text[i:i + 12]!r}")


@dataclass
class Member:
    """One ``"key": value`` of an object being scanned."""

    key: str
    #: where the value starts in the text.
    start: int
    #: where it ends (exclusive); None while it is incomplete.
    end: int | None


@dataclass
class ObjectScan:
    members: list[Member]
    #: end (exclusive) of the object; None while incomplete or when malformed.
    end: int | None
    #: the text stops being a JSON object after ``members``.
    malformed: bool = False

    def get(self, *keys: str) -> Member | None:
        """The first member named by one of ``keys`` (in the order of ``keys``)."""
        for key in keys:
            for m in self.members:
                if m.key == key:
                    return m
        return None


def scan_object(text: str, i: int, final: bool) -> ObjectScan:
    """The members of the JSON object starting at ``text[i] == '{'`` as far as the text goes."""
    n, members = len(text), []
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        return ObjectScan(members, j + 1)
    while True:
        j = skip_ws(text, j)
        if j >= n:
            return ObjectScan(members, None)
        if text[j] != '"':
            return ObjectScan(members, None, malformed=True)
        key_end = scan_string(text, j)
        if key_end is None:
            return ObjectScan(members, None)
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= n:
            return ObjectScan(members, None)
        if text[j] != ":":
            return ObjectScan(members, None, malformed=True)
        j = skip_ws(text, j + 1)
        if j >= n:
            return ObjectScan(members, None)
        try:
            value_end = scan_value(text, j, final)
        except MalformedJSON:
            return ObjectScan(members, None, malformed=True)
        members.append(Member(key, j, value_end))
        if value_end is None:
            return ObjectScan(members, None)
        j = skip_ws(text, value_end)
        if j >= n:
            return ObjectScan(members, None)
        if text[j] == "}":
            return ObjectScan(members, j + 1)
        if text[j] != ",":
            return ObjectScan(members, None, malformed=True)
        j += 1
