"""``ServerArgs``: the one source of truth for configuration.

CLI flags are generated from these fields (``--max-total-tokens`` for
``max_total_tokens``), a YAML file (``--config deploy.yaml``) fills the same
fields, explicit flags override the file, and ``Engine(**kwargs)`` takes the
same names. Validation errors are ``ConfigError`` naming the field, the value
and what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from engine.errors import ConfigError, did_you_mean

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
EVICTION_POLICIES = ("lru", "lfu")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
LOG_LEVELS = ("debug", "info", "warning", "error")
TASKS = ("auto", "generate", "embed", "score")
#: Projections a LoRA adapter may target (PEFT's module names in Llama-family checkpoints).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None, cli: bool = True, **kw: Any) -> Any:
    """A ServerArgs field with its help text (and accepted values, checked on validate)."""
    meta = {"help": help, "choices": choices, "cli": cli}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class ServerArgs:
    # -- model --------------------------------------------------------------
    model_path: str | None = opt(None, "Hugging Face model directory, or a GGUF file (or a directory holding one); default: the embedded SmolLM2-135M-Instruct")
    tokenizer_path: str | None = opt(None, "Tokenizer directory (default: the model directory)")
    served_model_name: str | None = opt(None, "Model name reported by the API (default: the directory name)")
    load_format: str = opt("auto", "Weight format; 'dummy' makes random weights from config.json alone", LOAD_FORMATS)
    dtype: str = opt("auto", "Activation and weight dtype; 'auto' takes the checkpoint's torch_dtype", DTYPES)
    context_length: int | None = opt(None, "Maximum tokens per request (default: the model's max_position_embeddings)")
    skip_tokenizer_init: bool = opt(False, "Run without a tokenizer: requests give input_ids, outputs are ids")
    trust_remote_code: bool = opt(False, "Allow custom code from the model directory (transformers)")
    task: str = opt("auto", "What the model serves: generate (text), embed (pooled vectors, /v1/embeddings) or score (classification/reward heads); 'auto' chooses from the checkpoint's architecture (BertModel: embed, *ForSequenceClassification: score, causal LMs: generate). With embed and no --model-path the embedded all-MiniLM-L6-v2 is served", TASKS)
    enable_matryoshka: bool = opt(False, "Accept the embeddings 'dimensions' field (truncate, then normalise) on a model whose config.json does not declare Matryoshka training (is_matryoshka, matryoshka_dimensions)")
    # -- plugins ------------------------------------------------------------
    attention: str | None = opt(None, "Attention backend plugin (default: the platform's choice)")
    quant: str | None = opt(None, "Quantization method plugin (default: the checkpoint's quantization_config)")
    platform: str | None = opt(None, "Hardware platform plugin (default: auto-detected)")
    schedule_policy: str = opt("fcfs", "Schedule policy plugin ordering the waiting queue")
    grammar_backend: str = opt("xgrammar", "Grammar backend plugin for structured output (json_schema, regex, ebnf, response_format)")
    tool_call_parser: str | None = opt(None, "Tool-call parser plugin reading calls from the output of requests with tools and tool_choice auto (hermes, llama3, mistral); default: none, the output stays text")
    reasoning_parser: str | None = opt(None, "Reasoning parser plugin splitting reasoning_content from content (qwen3, deepseek-r1); default: none")
    disable_plugin: list[str] = opt([], "Plugin not to load: its entry-point name, or a name it registers (hermes for toolparser_hermes); repeatable")
    required_plugins: list[str] = opt([], "Plugins that must be installed, with optional version specifiers, e.g. 'plugserve-attention-triton>=0.1'")
    plugin_options: dict[str, Any] = opt({}, "Options contributed by plugins, as {plugin: {key: value}}", cli=False)
    # -- memory and scheduling ----------------------------------------------
    max_total_tokens: int | None = opt(None, "KV-pool size in tokens (caps the pool; default: from --mem-fraction-static)")
    mem_fraction_static: float | None = opt(None, "Fraction of device memory for weights + KV pool (default: platform's)")
    max_running_requests: int | None = opt(None, "Most requests decoded at once")
    max_prefill_tokens: int = opt(16384, "Most new prompt tokens admitted into one prefill batch")
    chunked_prefill_size: int = opt(8192, "Split prompts into chunks of at most this many tokens; 0 or -1 disables")
    page_size: int = opt(1, "Tokens per KV page")
    kv_cache_dtype: str = opt("auto", "KV-cache storage dtype; 'auto' is the activation dtype, fp8_* store K/V in 8 bits with per-layer scales (from the checkpoint, else 1.0), doubling the tokens the pool holds", KV_CACHE_DTYPES)
    disable_radix_cache: bool = opt(False, "Use a plain chunk cache instead of the radix prefix cache")
    radix_eviction_policy: str = opt("lru", "Which unlocked radix-cache leaves are evicted first", EVICTION_POLICIES)
    enable_hierarchical_cache: bool = opt(False, "Keep prefixes evicted from the device KV pool in a storage tier (host memory by default) and load them back on a later match instead of recomputing them")
    hicache_ratio: float = opt(2.0, "Tier size as a multiple of the device KV pool's tokens (used when --hicache-size is 0)")
    hicache_size: float = opt(0.0, "Tier size in GB per rank; 0: --hicache-ratio decides")
    hicache_write_policy: str = opt("write_through", "When a prefix is copied to the tier: on insert (write_through) or when evicted from the device (write_back)", HICACHE_WRITE_POLICIES)
    hicache_storage_backend: str = opt("host", "KV storage tier plugin holding evicted prefixes: host (memory, built in), file (plugin kvtier-file), or another installed tier")
    schedule_conservativeness: float = opt(1.0, "Higher reserves more KV for future decode tokens when admitting requests")
    disable_kv_plan: bool = opt(False, "Admit requests that cannot stop early (ignore_eos, no stop conditions) against all their remaining tokens at once, instead of the pool's exact future use and tail-first order for a queue larger than the pool")
    enable_mixed_chunk: bool = opt(False, "Run prefill chunks and decode rows in one mixed batch")
    enable_priority_preemption: bool = opt(False, "Let the schedule policy retract running requests for more urgent waiting ones (priority policy)")
    # -- device execution ---------------------------------------------------
    disable_cuda_graph: bool = opt(False, "Do not capture decode steps in CUDA graphs")
    cuda_graph_max_bs: int = opt(1024, "Largest decode batch captured in a CUDA graph (graphs stop at the running-request limit too)")
    disable_overlap_schedule: bool = opt(False, "Do not prepare the next batch while the device runs the current one")
    cpu_threads: int | None = opt(None, "CPU threads each scheduler rank computes with (default: OMP_NUM_THREADS if set, else the cores this process may use less one, split over the ranks on this machine); the server's other processes use one each")
    tp_size: int = opt(1, "Tensor-parallel size: ranks (one process and device each) splitting every layer's heads and MLP")
    pp_size: int = opt(1, "Pipeline-parallel size: stages splitting the layers; a replica runs tp_size * pp_size ranks")
    ep_size: int = opt(1, "Expert-parallel size (mixture-of-experts models): the tensor-parallel ranks split the experts this many ways instead of splitting every expert; a divisor of --tp-size")
    nnodes: int = opt(1, "Machines one replica's ranks are spread over (each runs tp_size * pp_size / nnodes of them)")
    node_rank: int = opt(0, "This machine's index among --nnodes; node 0 runs the HTTP server, the others only their ranks")
    dist_init_addr: str | None = opt(None, "HOST:PORT where rank 0 meets the other ranks (torch.distributed rendezvous); required with --nnodes > 1, default a free port on 127.0.0.1")
    dist_timeout_s: float = opt(300.0, "Seconds the ranks wait for each other: for all nodes to join at start-up, and for any one collective")
    enable_custom_all_reduce: bool = opt(False, "CUDA, one host: tensor-parallel all-reduces up to 2 MiB as one kernel of this project over peer memory (torch symmetric memory, no multicast) instead of NCCL")
    dp_size: int = opt(1, "Data-parallel size: replicas of the model, each with its own scheduler process, KV pool and device(s), behind one server")
    enable_dp_attention: bool = opt(False, "DP attention, with --tp-size N --dp-size N: each of the N replicas runs attention on its own requests and KV, and the MLPs (experts by --ep-size) run tensor-parallel across all N, on every replica's tokens gathered; for MLA models, whose KV does not split by heads")
    router_policy: str = opt("cache-aware", "How requests are spread over the --dp-size replicas (a router-policy plugin): cache-aware, round-robin, shortest-queue")
    # -- prefill/decode disaggregation (docs/disaggregation.md) ----------------------
    disaggregation_mode: str = opt("null", "Serve one half of disaggregated requests (those carrying a bootstrap_room, sent by `engine router --prefill/--decode`): prefill computes the prompt's KV and first token and hands the KV over, decode receives it and generates the rest; null: a whole server", DISAGGREGATION_MODES)
    disaggregation_bootstrap_port: int = opt(8998, "Prefill mode: the port (on --host) decode servers fetch KV from")
    disaggregation_transfer_backend: str = opt("zmq", "KV transfer backend plugin moving prompt KV from prefill to decode servers, the same on both: zmq (TCP from host memory), torch (torch.distributed send/recv: gloo on CPU, NCCL on CUDA) or cuda_ipc (CUDA pools on one machine: device to device)")
    disaggregation_timeout_s: float = opt(60.0, "Seconds a decode server waits for a request's KV (and a prefill server keeps KV no decode server fetched) before the request fails")
    random_seed: int = opt(0, "Seed for weights of --load-format dummy and for unseeded sampling")
    # -- speculative decoding (docs/speculative.md) ----------------------------
    speculative_algorithm: str | None = opt(None, "Speculative-decoding proposer plugin (ngram, draft); default: none, one token per decode step")
    speculative_num_steps: int = opt(4, "Draft depth: draft tokens per request and step of a chain proposer (model proposers run this many steps)")
    speculative_num_draft_tokens: int | None = opt(None, "Tokens verified per request and step, the last accepted one included (default: --speculative-num-steps + 1)")
    speculative_eagle_topk: int = opt(1, "Branching of tree-drafting proposers (eagle); 1 drafts chains")
    speculative_draft_model_path: str | None = opt(None, "Checkpoint of the draft model (--speculative-algorithm draft): same tokenizer as the target")
    speculative_max_batch_size: int = opt(8, "Speculate only while at most this many requests decode; larger batches decode one token per step")
    # -- LoRA adapters (docs/lora.md) -------------------------------------------
    enable_lora: bool = opt(False, "Serve LoRA adapters; implied by --lora-paths, and alone it allows loading adapters at run time (/load_lora_adapter)")
    lora_paths: dict[str, str] = opt({}, "LoRA adapters loaded at start: NAME=PATH (a PEFT adapter directory) or a bare PATH (named after its directory); one flag may take several (YAML: a list or a mapping)")
    max_loras_per_batch: int = opt(8, "Distinct LoRA adapters one forward may use (adapter slots in device memory); base-model requests need none")
    max_loaded_loras: int | None = opt(None, "LoRA adapters kept in host memory; loading one more unloads the least recently used unpinned adapter no request is using (default: no limit)")
    max_lora_rank: int | None = opt(None, "Largest LoRA rank served (sizes the device slots; default: the largest rank among --lora-paths, else 64)")
    lora_target_modules: list[str] = opt([], "Projections adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all (default: those of the --lora-paths adapters, else all)")
    lora_backend: str = opt("auto", "LoRA backend plugin computing the adapters' shrink/expand products; 'auto': triton on CUDA/ROCm when installed, else torch_native")
    # -- server -------------------------------------------------------------
    host: str = opt("127.0.0.1", "HTTP bind address")
    port: int = opt(30000, "HTTP port")
    grpc_port: int | None = opt(None, "Also serve the native API over gRPC on this port, on --host, beside HTTP (needs the plugserve-grpc distribution; docs/grpc.md)")
    api_key: str | None = opt(None, "Require 'Authorization: Bearer KEY' on every route but /health (default: the ENGINE_API_KEY environment variable, if set)")
    allowed_origins: list[str] = opt([], "Browser origin allowed to call the API (CORS), e.g. http://localhost:3000, or * for any; repeatable; default: none")
    metrics_compat: str = opt("none", "Also export /metrics under SGLang's (sglang:*) or vLLM's (vllm:*) names and bucket layouts, or both (all), so their Grafana dashboards work unchanged", ("none", "sglang", "vllm", "all"))
    disable_dashboard: bool = opt(False, "Do not serve the live view at /dashboard (and its event feed /dashboard/feed)")
    otlp_traces_endpoint: str | None = opt(None, "Export an OpenTelemetry trace per request (its queue, prefill and decode stages) over OTLP/HTTP to this URL, e.g. http://localhost:4318/v1/traces (needs the core's 'tracing' extra); default: off")
    responses_store_size: int = opt(1000, "Responses kept for /v1/responses previous_response_id and GET (in memory); the least recently used are evicted beyond it")
    stream_interval: int = opt(1, "Stream to the client every N generated tokens")
    tokenizer_workers: int = opt(2, "Threads tokenizing prompts and rendering chat templates off the HTTP event loop; 0 tokenizes on the loop")
    allow_remote_media: bool = opt(False, "Fetch http(s) image and video URLs in requests (limited to --max-body-bytes and 10 s each); default: only data: URLs and local files")
    limit_mm_per_prompt: int = opt(16, "Most images plus videos one request may carry (vision-language models); more is a 400")
    mm_embedding_cache_mb: int = opt(256, "Device memory for image and video embeddings cached by image hash (vision-language models; taken from the KV cache's share)")
    max_body_bytes: int = opt(32 * 1024 * 1024, "Largest HTTP request body in bytes; larger ones are refused with 413")
    shutdown_grace_s: float = opt(10.0, "On SIGTERM/SIGINT, seconds in-flight requests may run before they are ended with a 503 error")
    log_level: str = opt("info", "Log verbosity", LOG_LEVELS)

    # ---------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "") -> ServerArgs:
        """Builds ServerArgs from a mapping; unknown keys are an error with a suggestion."""
        names = cls.field_names()
        for key in values:
            if key not in names:
                raise ConfigError(f"unknown key '{key}'{where}{did_you_mean(key, names)}")
        hints = typing.get_type_hints(cls)
        if "lora_paths" in values:
            values = {**values, "lora_paths": parse_lora_paths(values["lora_paths"])}
        kwargs = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
        args = cls(**kwargs)
        args.validate()
        return args

    @classmethod
    def from_yaml(cls, path: str, overrides: dict[str, Any] | None = None) -> ServerArgs:
        """Reads a YAML deployment file; ``overrides`` (explicit flags) win over it."""
        values = load_yaml(path)
        values.update(overrides or {})
        return cls.from_dict(values, where=f" in {path}")

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{_flag(f.name)}: invalid value {value!r}; accepted: {', '.join(choices)}")
        _positive(self, "tp_size", "dp_size", "page_size", "max_prefill_tokens", "cuda_graph_max_bs", "stream_interval")
        _positive_or_none(self, "max_total_tokens", "max_running_requests", "context_length")
        _positive(self, "max_body_bytes", "limit_mm_per_prompt")
        if self.mm_embedding_cache_mb < 0:
            raise ConfigError(f"--mm-embedding-cache-mb: invalid value {self.mm_embedding_cache_mb}; accepted: an integer >= 0")
        if self.responses_store_size < 0:
            raise ConfigError(f"--responses-store-size: invalid value {self.responses_store_size}; accepted: an integer >= 0 (0 stores nothing)")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"--cpu-threads: invalid value {self.cpu_threads}; accepted: an integer >= 1")
        if self.tokenizer_workers < 0:
            raise ConfigError(f"--tokenizer-workers: invalid value {self.tokenizer_workers}; accepted: an integer >= 0")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"--shutdown-grace-s: invalid value {self.shutdown_grace_s}; accepted: a number of seconds >= 0")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(f"--mem-fraction-static: invalid value {self.mem_fraction_static}; accepted: a number between 0 and 1")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port: invalid value {self.port}; accepted: 1..65535")
        if self.otlp_traces_endpoint is not None:
            _check_otlp_endpoint(self.otlp_traces_endpoint)
        if self.grpc_port is not None and (not 0 < self.grpc_port < 65536 or self.grpc_port == self.port):
            raise ConfigError(f"--grpc-port: invalid value {self.grpc_port}; accepted: 1..65535, other than --port ({self.port})")
        if self.hicache_ratio <= 0:
            raise ConfigError(f"--hicache-ratio: invalid value {self.hicache_ratio}; accepted: a number > 0")
        if self.hicache_size < 0:
            raise ConfigError(f"--hicache-size: invalid value {self.hicache_size}; accepted: a number of GB >= 0 (0: --hicache-ratio decides)")
        if self.enable_hierarchical_cache:
            self._validate_hicache()
        if self.schedule_conservativeness <= 0:
            raise ConfigError(f"--schedule-conservativeness: invalid value {self.schedule_conservativeness}; accepted: > 0")
        self._validate_parallel()
        self._validate_lora()
        self._validate_disaggregation()
        if not isinstance(self.plugin_options, dict) or not all(isinstance(v, dict) for v in self.plugin_options.values()):
            raise ConfigError("plugin_options: expected a mapping {plugin: {key: value}}")
        if self.disable_plugin:
            from engine.plugins import resolve_plugin_names

            # A misspelt name would otherwise disable nothing, silently. A name users select an
            # implementation by (``hermes``) stands for the plugin registering it (``toolparser_hermes``).
            self.disable_plugin = resolve_plugin_names(self.disable_plugin, "--disable-plugin")
        self._validate_parsers()
        self._validate_grammar_backend()
        if self.speculative_algorithm:
            from engine.speculative.checks import check_speculative_args

            check_speculative_args(self)

    def _validate_hicache(self) -> None:
        if self.disable_radix_cache:
            raise ConfigError("--enable-hierarchical-cache: needs the radix cache; accepted: without --disable-radix-cache")
        import engine.plugins as plugins
        from engine.errors import PluginError

        try:
            plugins.get_kv_storage_tier(self.hicache_storage_backend, self.disable_plugin)
        except (ConfigError, PluginError) as exc:
            raise PluginError(f"--hicache-storage-backend: {exc}") from None

    @property
    def lora_enabled(self) -> bool:
        """LoRA is on with start-up adapters or --enable-lora (run-time loading only)."""
        return self.enable_lora or bool(self.lora_paths)

    def _validate_disaggregation(self) -> None:
        if self.disaggregation_timeout_s <= 0:
            raise ConfigError(f"--disaggregation-timeout-s: invalid value {self.disaggregation_timeout_s}; "
                              "accepted: a number of seconds > 0")
        if self.disaggregation_mode == "null":
            return
        if not 0 < self.disaggregation_bootstrap_port < 65536 or self.disaggregation_bootstrap_port == self.port:
            raise ConfigError(f"--disaggregation-bootstrap-port: invalid value {self.disaggregation_bootstrap_port}; "
                              f"accepted: 1..65535, other than --port ({self.port})")
        many = [f"{_flag(name)} {getattr(self, name)}" for name in ("tp_size", "pp_size", "dp_size") if getattr(self, name) != 1]
        if many:
            raise ConfigError(f"--disaggregation-mode {self.disaggregation_mode}: runs one rank per server (the KV of "
                              f"one pool moves as a whole); {', '.join(many)} is not supported; accepted: 1")
        if self.disaggregation_mode == "decode" and self.speculative_algorithm:
            # Its proposers start from the target's prefill (hidden states, drafts), which ran elsewhere.
            raise ConfigError(f"--speculative-algorithm {self.speculative_algorithm}: not supported with "
                              "--disaggregation-mode decode; accepted: none")
        import engine.plugins as plugins
        from engine.errors import PluginError

        try:
            plugins.get_kv_transfer_backend(self.disaggregation_transfer_backend, self.disable_plugin)
        except (ConfigError, PluginError) as exc:
            raise PluginError(f"--disaggregation-transfer-backend: {exc}") from None

    def _validate_lora(self) -> None:
        self.lora_paths = parse_lora_paths(self.lora_paths)
        _positive(self, "max_loras_per_batch")
        _positive_or_none(self, "max_loaded_loras", "max_lora_rank")
        for name, path in self.lora_paths.items():
            if not os.path.isdir(path):
                raise ConfigError(f"--lora-paths: {name}={path}: not a directory; accepted: a PEFT adapter "
                                  "directory (adapter_config.json and adapter_model.safetensors)")
        if self.max_loaded_loras is not None and len(self.lora_paths) > self.max_loaded_loras:
            raise ConfigError(f"--max-loaded-loras: invalid value {self.max_loaded_loras}; accepted: at least the "
                              f"{len(self.lora_paths)} adapters of --lora-paths")
        targets = list(self.lora_target_modules)
        if targets == ["all"]:
            self.lora_target_modules = list(LORA_TARGET_MODULES)
        else:
            for name in targets:
                if name not in LORA_TARGET_MODULES:
                    raise ConfigError(f"--lora-target-modules: invalid value {name!r}; accepted: "
                                      f"{', '.join(LORA_TARGET_MODULES)}, or all{did_you_mean(name, LORA_TARGET_MODULES)}")
        if not self.lora_enabled:
            return
        if self.speculative_algorithm:
            raise ConfigError(f"--speculative-algorithm: invalid value {self.speculative_algorithm!r} with LoRA "
                              "adapters; accepted: none (the proposers draft without the adapters)")
        if self.lora_backend != "auto":
            import engine.plugins as plugins
            from engine.errors import PluginError

            try:
                plugins.get_lora_backend(self.lora_backend, self.disable_plugin)
            except PluginError as exc:
                raise PluginError(f"--lora-backend: {exc}") from None

    def _validate_grammar_backend(self) -> None:
        """``--grammar-backend`` names an installed grammar backend (the error lists them)."""
        import engine.plugins as plugins
        from engine.errors import PluginError

        try:
            plugins.get_grammar_backend(self.grammar_backend, self.disable_plugin)
        except PluginError as exc:
            raise PluginError(f"--grammar-backend: {exc}") from None

    def _validate_parsers(self) -> None:
        """``--tool-call-parser`` and ``--reasoning-parser`` name registered parsers (before any process starts)."""
        import engine.plugins as plugins
        from engine.errors import PluginError

        for flag, name, get in (("--tool-call-parser", self.tool_call_parser, plugins.get_tool_call_parser),
                                ("--reasoning-parser", self.reasoning_parser, plugins.get_reasoning_parser)):
            if name is None:
                continue
            try:
                get(name, self.disable_plugin)
            except PluginError as exc:
                raise PluginError(f"{flag}: {exc}") from None

    def _validate_parallel(self) -> None:
        _positive(self, "pp_size", "nnodes", "ep_size")
        if self.tp_size % self.ep_size:
            raise ConfigError(f"--ep-size: invalid value {self.ep_size}; accepted: a divisor of --tp-size ({self.tp_size}): "
                              "expert parallelism splits the experts across the tensor-parallel ranks")
        world = self.tp_size * self.pp_size
        if world % self.nnodes:
            raise ConfigError(f"--nnodes: invalid value {self.nnodes}; accepted: a divisor of --tp-size x --pp-size "
                              f"({world}), so each node runs the same number of ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank: invalid value {self.node_rank}; accepted: 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("--dist-init-addr: required with --nnodes > 1 (HOST:PORT of node 0, reachable from every node)")
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--dist-init-addr: invalid value {self.dist_init_addr!r}; accepted: HOST:PORT, e.g. 10.0.0.1:29500")
        if self.dist_timeout_s <= 0:
            raise ConfigError(f"--dist-timeout-s: invalid value {self.dist_timeout_s}; accepted: a number of seconds > 0")
        if self.enable_dp_attention:
            self._validate_dp_attention()

    def _validate_dp_attention(self) -> None:
        if self.tp_size != self.dp_size or self.tp_size < 2:
            raise ConfigError(f"--enable-dp-attention: needs --tp-size N --dp-size N with N >= 2; got --tp-size "
                              f"{self.tp_size} --dp-size {self.dp_size}")
        for flag, value, off in (("--pp-size", self.pp_size, 1), ("--nnodes", self.nnodes, 1),
                                 ("--speculative-algorithm", self.speculative_algorithm, None)):
            if value != off:
                raise ConfigError(f"{flag}: invalid value {value!r} with --enable-dp-attention; accepted: {off} "
                                  "(the replicas run one forward per step, on one node)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def chunked_prefill_enabled(self) -> bool:
        return self.chunked_prefill_size > 0


def parse_lora_paths(value: Any) -> dict[str, str]:
    """``--lora-paths`` / YAML ``lora_paths`` as {name: path}: a mapping, or a list (or one string)
    of ``NAME=PATH`` and bare ``PATH`` items, a bare path being named after its directory."""
    if isinstance(value, dict):
        items = [(k, v) for k, v in value.items()]
        for k, v in items:
            if not isinstance(k, str) or not isinstance(v, str):
                raise ConfigError(f"--lora-paths: invalid entry {k!r}: {v!r}; accepted: NAME: PATH (strings)")
    elif isinstance(value, (list, tuple, str)):
        items = []
        for item in [value] if isinstance(value, str) else value:
            if not isinstance(item, str):
                raise ConfigError(f"--lora-paths: invalid value {item!r}; accepted: NAME=PATH or PATH")
            name, sep, path = item.partition("=")
            if not sep:
                path = item
                name = os.path.basename(os.path.normpath(item))
            items.append((name, path))
    else:
        raise ConfigError(f"--lora-paths: invalid value {value!r}; accepted: NAME=PATH items or a mapping")
    out: dict[str, str] = {}
    for name, path in items:
        if not name or not path or any(c.isspace() for c in name):
            raise ConfigError(f"--lora-paths: invalid value {name}={path!r}; accepted: NAME=PATH with a non-empty "
                              "name without spaces and a path")
        if name in out:
            raise ConfigError(f"--lora-paths: adapter name {name!r} is given twice ({out[name]}, {path}); names must differ")
        out[name] = path
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_otlp_endpoint(url: str) -> None:
    """An http(s) URL, and the OpenTelemetry SDK and OTLP/HTTP exporter installed (checked before
    the model loads, not after)."""
    import importlib.util
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"--otlp-traces-endpoint: invalid value {url!r}; accepted: an http(s) URL of an OTLP/HTTP "
                          "collector, e.g. http://localhost:4318/v1/traces")
    for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ConfigError(f"--otlp-traces-endpoint: {module} is not installed; "
                              "install the core's tracing extra: pip install 'plugserve-core[tracing]'")


def _positive(args: ServerArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"{_flag(name)}: invalid value {value}; accepted: an integer >= 1")


def _positive_or_none(args: ServerArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"{_flag(name)}: invalid value {value}; accepted: an integer >= 1")


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Checks a YAML/kwarg value against the field's type, converting where lossless."""
    if value is None:
        return None
    args = typing.get_args(hint)
    base = next((a for a in args if a is not type(None)), hint) if args and type(None) in args else hint
    origin = typing.get_origin(base) or base
    bad = ConfigError(f"{name}: invalid value {value!r}; expected {_type_name(base)}")
    if origin is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if origin is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if origin is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if origin is str:
        if not isinstance(value, str):
            raise bad
        return value
    if origin is list:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad
        return list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    return value


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t) or t
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            list: "a list of strings", dict: "a mapping"}.get(origin, str(t))


def load_yaml(path: str) -> dict[str, Any]:
    """Reads a YAML mapping, turning every problem into a one-line ConfigError."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config: file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"--config: invalid YAML in {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of option names to values, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def check_required_plugins(requirements: list[str]) -> None:
    """Checks ``required_plugins`` entries such as ``plugserve-attention-triton>=0.1``."""
    from importlib_metadata import PackageNotFoundError, version
    from packaging.requirements import InvalidRequirement, Requirement

    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            raise ConfigError(f"required_plugins: invalid requirement {text!r}; expected e.g. 'plugserve-attention-triton>=0.1'") from None
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            raise ConfigError(f"required_plugins: '{req.name}' is not installed (pip install '{text}')") from None
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            raise ConfigError(f"required_plugins: '{req.name}' {installed} is installed but {text!r} is required")
