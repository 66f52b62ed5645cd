"""The JSON encoding of streamed events: ``json.dumps(o, ensure_ascii=False, separators=(",", ":"))``'s
text, with less work per call.

``JSONEncoder.encode`` builds a new C encoder object (and a dict for its circular-reference
check) on every call; for the small dicts of a streamed event that set-up is most of the cost
(a /generate event's ``meta_info``: ~7 us, of which the encoding proper ~3). Here one C encoder
is built once, without the circular check: an event's payload is a tree the server built, never
circular. Where CPython's C accelerator is missing, the plain encoder is used (with a warning:
same text, slower).
"""

from __future__ import annotations

import json
import json.encoder
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_PLAIN = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _make_encoder() -> Callable[[Any], str]:
    make = getattr(json.encoder, "c_make_encoder", None)
    strings = json.encoder.encode_basestring
    if make is None:
        logger.warning("json.encoder.c_make_encoder is missing (no C accelerator): streamed events use "
                       "json.JSONEncoder.encode, the same text at a higher cost per event")
        return _PLAIN.encode
    # The arguments JSONEncoder.iterencode passes for these options, with markers=None (no
    # circular check): default, string encoder, indent, key and item separators, sort_keys,
    # skipkeys, allow_nan.
    encode_tree = make(None, _PLAIN.default, strings, None, ":", ",", False, False, True)

    def encode(o: Any) -> str:
        if isinstance(o, str):
            return strings(o)
        return "".join(encode_tree(o, 0))

    return encode


encode_json: Callable[[Any], str] = _make_encoder()
