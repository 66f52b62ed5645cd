"""``BenchServingArgs``: the settings of ``engine bench serving``, free of any CLI library.

Kept apart from engine.bench.serving so a CLI can build and validate it without importing
the HTTP client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.bench.backends import BACKENDS
from engine.bench.datasets import DatasetArgs

DEFAULT_PORTS = {
    "engine": 30000,
    "sglang": 30000,
    "openai": 30000,
    "openai-chat": 30000,
    "vllm": 8000,
}


@dataclass
class BenchServingArgs(DatasetArgs):
    """Settings of one serving benchmark.

    Fields are SGLang's bench_serving flags with dashes as underscores (``--max-concurrency``
    is ``max_concurrency``); comments mark the few that SGLang spells differently or lacks.
    """

    # Request format: "engine"/"sglang" (POST /generate), "openai"/"vllm" (/v1/completions),
    # "openai-chat" (/v1/chat/completions).
    backend: str = "engine"
    # Server root such as "http://10.0.0.5:30000"; overrides host and port.
    base_url: str | None = None
    host: str = "127.0.0.1"
    # None picks the backend's usual port (DEFAULT_PORTS).
    port: int | None = None
    # Model name sent to OpenAI APIs; None asks GET /v1/models.
    model: str | None = None
    # Tokenizer name or path for counting and decoding; None falls back to the model name.
    tokenizer: str | None = None
    # Load no tokenizer: prompts are random token ids from vocab_size (--skip-tokenizer-init).
    skip_tokenizer_init: bool = False
    # Send token ids even when a tokenizer is loaded, for exact prompt lengths (--tokenize-prompt).
    tokenize_prompt: bool = False
    # Requests per second; inf sends every request at time 0.
    request_rate: float = math.inf
    # Cap on requests in flight; None means no cap.
    max_concurrency: int | None = None
    # Ask for whole responses instead of SSE streams; TTFT then equals latency.
    disable_stream: bool = False
    # Let requests stop at EOS instead of always generating output_len tokens.
    disable_ignore_eos: bool = False
    # Merged into every request payload (--extra-request-body, parsed JSON).
    extra_request_body: dict[str, Any] | None = None
    # Append a JSON line of settings and metrics here (--result-file; SGLang: --output-file).
    result_file: str | None = None
    # Add per-request lengths, TTFTs, ITLs, texts and errors to that line (--output-details).
    output_details: bool = False
    # Requests sent and discarded before measuring (--warmup-requests).
    warmup_requests: int = 1
    # No progress lines on stderr (--disable-tqdm).
    disable_tqdm: bool = False
    # Processes sending the requests (request i from process i % N), each with its own event loop
    # and connections: one process parses ~10k streamed events a second at most (not an SGLang flag).
    client_processes: int = 1
    # Do not sample the server's scheduler counters (GET /get_server_info every 0.5 s) for the
    # report's server section (not an SGLang flag; servers without them are skipped anyway).
    disable_server_stats: bool = False
    # Bearer token; None reads OPENAI_API_KEY (not an SGLang flag).
    api_key: str | None = None
    # Per-request HTTP timeout in seconds; long generations under load can take hours
    # (not an SGLang flag).
    request_timeout_s: float = 6 * 3600.0
    # Structured output (not SGLang flags): a JSON Schema file every request's output must follow
    # ('' = the built-in benchmark schema); sent as /generate's json_schema or OpenAI's
    # response_format.
    json_schema: str | None = None
    # Give each request its own copy of the schema (a distinct title), so each one compiles:
    # the time to first token with a new schema instead of a cached one.
    json_schema_unique: bool = False
    # LoRA adapters the server has loaded (--lora-name A B ...): each request picks one at random
    # (seeded), as SGLang's bench_serving does; sent as /generate's lora_path or OpenAI's model.
    lora_name: list[str] | None = None
    # --dataset-name image (SGLang's flags): images per request, their size and encoding.
    image_count: int = 1
    image_resolution: str = "1024x1024"
    image_format: str = "jpeg"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; accepted: {', '.join(BACKENDS)}")
        if not self.request_rate > 0:
            raise ValueError(
                f"--request-rate must be > 0 (inf for all at once), got {self.request_rate}"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1 or unset, got {self.max_concurrency}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {self.warmup_requests}")
        if self.lora_name is not None and not self.lora_name:
            raise ValueError("--lora-name: expected one or more adapter names, got none")
        if self.client_processes < 1:
            raise ValueError(f"--client-processes must be >= 1, got {self.client_processes}")
        if self.client_processes > 1 and (self.max_concurrency or self.json_schema_unique):
            flag = "--max-concurrency" if self.max_concurrency else "--json-schema-unique"
            raise ValueError(f"--client-processes {self.client_processes}: not with {flag} (it needs one "
                             "process that sees every request); accepted: --client-processes 1")
        if self.dataset_name == "image" and self.backend != "openai-chat":
            raise ValueError(f"--dataset-name image: images go through the chat API; accepted --backend: "
                             f"openai-chat (got {self.backend!r})")

    def server_url(self) -> str:
        """Root URL of the server, without a trailing slash."""
        if self.base_url:
            return self.base_url.rstrip("/")
        return f"http://{self.host}:{self.port or DEFAULT_PORTS[self.backend]}"
