"""Scanning JSON that is still being written: incomplete is None, never an error."""

from __future__ import annotations

import pytest

from engine.parsers.scan import MalformedJSON, partial_tag_len, scan_object, scan_value


def test_partial_tag_len() -> None:
    assert partial_tag_len("text <tool_", "<tool_call>") == 6
    assert partial_tag_len("text <", "<tool_call>") == 1
    assert partial_tag_len("text", "<tool_call>") == 0
    assert partial_tag_len("<tool_call>", "<tool_call>") == 0  # a whole tag is not held back


@pytest.mark.parametrize(("text", "end"), [
    ('"a\\"b" rest', 6), ('{"a": [1, "}"]} x', 15), ("[1, [2, 3]],", 11), ("-12.5e3,", 7), ("true}", 4),
])
def test_scan_value_finds_the_end(text: str, end: int) -> None:
    assert scan_value(text, 0, final=False) == end


@pytest.mark.parametrize("text", ['"abc', '{"a": [1, 2', "tru", "-1", "12.", "[{}"])
def test_incomplete_values_are_none(text: str) -> None:
    assert scan_value(text, 0, final=False) is None


def test_final_ends_a_number_at_the_end_of_the_text() -> None:
    assert scan_value("42", 0, final=True) == 2


def test_malformed() -> None:
    with pytest.raises(MalformedJSON):
        scan_value("nope", 0, final=False)


def test_scan_object_members_as_far_as_they_go() -> None:
    text = '{"name": "f", "arguments": {"a": [1, 2'
    obj = scan_object(text, 0, final=False)
    assert [m.key for m in obj.members] == ["name", "arguments"] and obj.end is None and not obj.malformed
    assert obj.members[1].end is None and text[obj.members[0].start:obj.members[0].end] == '"f"'
    done = scan_object('{"a": 1} tail', 0, final=False)
    assert done.end == 8
    assert scan_object('{"a" 1}', 0, final=False).malformed
