"""The conformance kit against the `int8wo` method."""

from __future__ import annotations

from engine.testing import QuantMethodConformance


class TestInt8WeightOnly(QuantMethodConformance):
    method_name = "int8wo"
    max_rel_error = 0.01
