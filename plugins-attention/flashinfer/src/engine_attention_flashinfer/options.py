"""Options accepted under the backend's name (``--plugin-option flashinfer.<key>=<value>``)."""

from __future__ import annotations

from typing import Any

#: Options and their defaults; the plugin registers the same names (see ``__init__``).
DEFAULT_OPTIONS: dict[str, int] = {
    # Float workspace shared by every wrapper (split-KV partial outputs), in MiB.
    # FlashInfer recommends 128 MiB; long contexts with large batches may need more.
    "workspace_mb": 128,
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
