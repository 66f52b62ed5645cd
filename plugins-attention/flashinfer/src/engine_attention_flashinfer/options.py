"""Options accepted under the backend's name (``--plugin-option flashinfer.<key>=<value>``)."""

from __future__ import annotations

from typing import Any

#: Options and their defaults; the plugin registers the same names (see ``__init__``).
DEFAULT_OPTIONS: dict[str, int] = {
    # Float workspace shared by every wrapper (split-KV partial outputs), in MiB. A split-KV
    # prefill of a full 8,192-token chunk at 32 heads x 128 needs ~320 MiB of it (2.5x the
    # chunk's float32 output), so 128 MiB overflows at the default --chunked-prefill-size;
    # SGLang's default is the same 384 MiB.
    "workspace_mb": 384,
}


def parse_options(options: dict[str, Any]) -> dict[str, int]:
    """Validates user options against ``DEFAULT_OPTIONS``; errors name what is accepted."""
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown option(s) for attention backend 'flashinfer': {', '.join(unknown)}; "
            f"accepted: {', '.join(sorted(DEFAULT_OPTIONS))}"
        )
    parsed = dict(DEFAULT_OPTIONS)
    for key, value in options.items():
        try:
            parsed[key] = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"flashinfer.{key}={value!r}; accepted: an integer") from None
    if parsed["workspace_mb"] < 16:
        raise ValueError(f"flashinfer.workspace_mb={parsed['workspace_mb']}; accepted: an int >= 16")
    return parsed
