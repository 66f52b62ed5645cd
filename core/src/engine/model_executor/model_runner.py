"""ModelRunner: owns the model, the KV pools and the attention backend of one worker."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import engine.distributed as distributed
from engine.attention import AttentionContext, check_backend_selectable
from engine.errors import ConfigError
from engine.hookspecs import resolve_factory
from engine.layers.logits_processor import LogitsProcessorOutput
from engine.layers.quantization.fusion import link_activation_quantizers, link_norm_consumers
from engine.layers.sampler import Sampler, SampleOutput
from engine.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    resolve_kv_cache_dtype,
)
from engine.model_executor.forward_batch import ForwardBatch
from engine.model_executor.checkpoint import load_hf_config
from engine.model_executor.model_loader import load_model
from engine.platforms import set_current_platform
from engine.selection import select_components

if TYPE_CHECKING:
    from engine.config import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class StageLaunch:
    """One micro-batch launched on this pipeline stage (``ModelRunner.forward_micro_batch``)."""

    # The last stage's logits; None on the other stages.
    logits: LogitsProcessorOutput | None
    # The hidden states on their way to the next stage (kept alive until sent); None on the last.
    sends: distributed.PendingSends | None


@dataclass
class PendingSample:
    """A micro-batch's sampled ids as every rank sees them (``ModelRunner.share_sample``)."""

    # World rank that samples and sends (tensor-parallel rank 0 of the last stage).
    src: int
    # (SampleOutput on the CPU, full logits on the CPU or None); None until received.
    result: tuple[SampleOutput, torch.Tensor | None] | None = None
    # The sampler's sends to the other ranks (kept alive until they complete).
    sends: distributed.PendingSends | None = None

    def get(self) -> tuple[SampleOutput, torch.Tensor | None]:
        """The result, receiving it from the last stage first if this rank did not sample."""
        if self.result is None:
            self.result = distributed.recv_objects(self.src, distributed.TAG_SAMPLES)
        assert self.result is not None
        return self.result

# Without --max-total-tokens a CPU pool is capped here as well as by the platform's byte budget:
# the allocator sorts its free list before each prefill, so a longer list costs every prefill.
_CPU_MAX_POOL_TOKENS = 1 << 17
_REQ_TO_TOKEN_BUDGET_BYTES = 512 << 20


class ModelRunner:
    def __init__(self, args: ServerArgs, model_path: str, platform: Any | None = None) -> None:
        self.args = args
        self.hf_config = load_hf_config(model_path, args.trust_remote_code)
        # The same choice and checks as the main process's preflight (engine.selection).
        self.selection = select_components(args, self.hf_config, platform)
        self.platform = self.selection.platform
        set_current_platform(self.platform)  # plugins ask it (fp8_dtype, events) through engine.platforms
        # Tensor/pipeline rank of this process (rank 0 of 1 unless the launcher started several).
        self.placement = distributed.get_placement()
        self.device = self.platform.device(self.placement.local_rank)
        self.platform.set_device(self.device)
        self.platform.seed_everything(args.random_seed)
        for line in self.selection.log_lines():
            logger.info(line)
        self.dtype = self.selection.dtype
        cfg = self.hf_config
        self.vocab_size = cfg.vocab_size
        self.num_layers = cfg.num_hidden_layers
        tp = self.placement.tp_size
        # DP attention: the placement's ep_size is its MLPs' (split over the replicas, checked at launch).
        ep = self.placement.ep_size if self.placement.dp_attn_size == 1 else 1
        distributed.check_model_parallel(cfg, tp, self.placement.pp_size, ep)
        # Heads of this tensor-parallel rank; KV heads are replicated when fewer than ranks.
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = max(1, total_kv_heads // tp)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # Layers of this pipeline stage: the KV pool holds only these.
        from engine.layers.pipeline import pp_layer_range

        self.start_layer, self.end_layer = pp_layer_range(self.num_layers)
        model_ctx = getattr(cfg, "max_position_embeddings", 2048)
        if args.context_length and args.context_length > model_ctx:
            raise ConfigError(f"--context-length: invalid value {args.context_length}; accepted: at most the model's max_position_embeddings ({model_ctx})")
        self.context_len = args.context_length or model_ctx
        self.kv_cache_dtype = self._resolve_kv_cache_dtype()

        free_before, _ = self.platform.memory_info(self.device)
        self.model = load_model(args, model_path, cfg, self.device, self.selection)
        # Encoders (bidirectional attention) compute every state in one forward and keep no KV.
        self.uses_kv_cache = bool(getattr(self.model, "uses_kv_cache", True))
        self._init_kv_layout()
        self._init_multimodal()
        self._init_pooling(model_path)
        # Weights quantized while loading (fp8 from a bf16 checkpoint, ...) freed their
        # full-precision copies into the allocator's cache; give that back to the device so the
        # pool is sized from the weights in their final form, not from the loading peak.
        self.platform.empty_cache()
        #: ``Platform.layer_kernels()``, asked once: offered to the model's layers and the KV pool.
        self.layer_kernels: dict[str, Any] = self.platform.layer_kernels()
        self._install_layer_kernels()
        link_activation_quantizers(self.model)
        #: LoRA adapters (``--lora-paths`` / ``--enable-lora``): slots on the target layers, sized
        #: before the KV pool so the pool is sized without them. None: LoRA off.
        self.lora: Any = None
        self._lora_capturing = False
        if args.lora_enabled:
            from engine.lora.setup import create_lora_manager

            self.lora = create_lora_manager(args, self.model, self.platform, self.dtype, self.device,
                                            (self.start_layer, self.end_layer))
        link_norm_consumers(self.model)  # after both: it needs the kernels and out_quant
        self._init_pools(free_before)
        if self.lora is not None:
            # Sized once for the largest decode batch: captured graphs keep reading these buffers.
            self.lora.static_rows(self.max_running_requests + 1)
        self.attn_backend = self._create_attention_backend()
        warmup = getattr(self.attn_backend, "warmup", None)
        if callable(warmup):
            # JIT-compiling backends build their kernels now, not on the first request.
            from engine.layers.radix_attention import RadixAttention

            warmup([m for m in self.model.modules() if isinstance(m, RadixAttention)])
        self.sampler = Sampler()
        self.sampler.use_kernels(self.layer_kernels)  # not in the model: _install_layer_kernels misses it
        # Hidden states every forward hands back (``ForwardBatch.capture_hidden``), set by a
        # speculative proposer that reads them (EAGLE); None: none.
        self.capture_hidden: tuple[int, ...] | None = None
        self.cuda_graph_runner = self._maybe_capture_graphs()

    def _init_multimodal(self) -> None:
        """A model with ``embed_multimodal`` takes images: its item-embedding cache (its budget is
        taken from the KV pool's) and, with ``mm_positions``, M-RoPE positions."""
        from engine.multimodal import is_multimodal, uses_mrope
        from engine.multimodal.runtime import EmbeddingCache

        self.multimodal = is_multimodal(self.model)
        self.mrope = uses_mrope(self.model)
        if self.multimodal and self.placement.pp_size > 1:
            raise ConfigError(f"--pp-size {self.placement.pp_size}: vision-language models "
                              f"({self.hf_config.architectures[0]}) run without pipeline parallelism; accepted: "
                              "--pp-size 1 (use --tp-size to split the model)")
        budget = (getattr(self.args, "mm_embedding_cache_mb", 0) << 20) if self.multimodal else 0
        self.mm_cache = EmbeddingCache(budget)

    def _maybe_capture_graphs(self) -> Any:
        args = self.args
        if args.disable_cuda_graph or not self.platform.supports_graph_capture() or self.task != "generate":
            return None  # pooling models run prefills only: no decode step to capture
        if self.placement.pp_size > 1:
            logger.info("pipeline parallelism: decode steps run eagerly (CUDA graphs off)")
            return None
        if self.placement.dp_attn_size > 1:  # the MLPs' token gathers size themselves on the host
            logger.info("DP attention: decode steps run eagerly (CUDA graphs off)")
            return None
        if not getattr(self.attn_backend, "supports_cuda_graph", False):
            logger.info("attention backend '%s' cannot be captured; CUDA graphs off", self.attention_backend_name)
            return None
        from engine.model_executor.cuda_graph_runner import CudaGraphRunner

        if self.lora is None:
            return CudaGraphRunner(self, args.cuda_graph_max_bs)
        # Decode graphs hold the LoRA path: captured on the static batch info, every replay
        # refills its buffers (``LoraManager.prepare(graph=True)``).
        self._lora_capturing = True
        try:
            return CudaGraphRunner(self, args.cuda_graph_max_bs)
        finally:
            self._lora_capturing = False
    # -- set-up -------------------------------------------------------------
    def _install_layer_kernels(self) -> None:
        """Offers the platform's fused kernels to every layer that can use them."""
        kernels = self.layer_kernels
        if not kernels:
            return
        for module in self.model.modules():
            use = getattr(module, "use_kernels", None)
            if callable(use):
                use(kernels)
        logger.info("fused layer kernels from platform '%s': %s", self.platform.name, ", ".join(sorted(kernels)))

    def _resolve_kv_cache_dtype(self) -> torch.dtype:
        """``--kv-cache-dtype`` as a storage dtype, checked against the platform and the backend."""
        name = self.args.kv_cache_dtype
        dtype = resolve_kv_cache_dtype(name, self.dtype)
        if name == "auto":
            return dtype
        if not self.platform.supports_dtype(dtype):
            raise ConfigError(f"--kv-cache-dtype {name}: platform '{self.platform.name}' cannot store "
                              f"{str(dtype).replace('torch.', '')} on this device ({self.platform.describe()}); "
                              "accepted here: auto")
        attention = self.selection.attention
        check_backend_selectable(attention.spec, self.platform.device_type, self.args.page_size, name)
        return dtype

    def _init_pooling(self, model_path: str) -> None:
        """``--task`` resolved from the architecture; for pooling tasks, the pooler (from the
        checkpoint's sentence-transformers files, else the architecture's default)."""
        from engine.layers.pooler import Pooler
        from engine.pooling import matryoshka_dimensions, read_pooling_config, resolve_task

        arch = self.hf_config.architectures[0]
        self.task = resolve_task(self.args.task, arch)
        self.pooler: Pooler | None = None
        self.pooling_config: Any = None
        self.embedding_size = 0
        if self.task == "generate":
            # Only the last pipeline stage holds the LM head; the others have none by design.
            last_stage = self.placement.pp_rank == self.placement.pp_size - 1
            if last_stage and getattr(self.model, "has_lm_head", True) is False:
                raise ConfigError("--task generate: the checkpoint has no LM head (lm_head.weight), so it cannot "
                                  "generate; accepted for it: --task embed")
            return
        if not callable(getattr(self.model, "forward_hidden", None)):
            raise ConfigError(f"--task {self.task}: the model plugin for {arch} cannot pool (its model class has no "
                              "forward_hidden); accepted for it: --task generate")
        if self.placement.pp_size > 1:
            raise ConfigError(f"--task {self.task}: pooling models run without pipeline parallelism; accepted: --pp-size 1")
        # A model without KV cache attends both ways (BERT): mean pooling by default, not the last token.
        config = read_pooling_config(model_path, arch, encoder=not self.uses_kv_cache)
        # A scoring model's head maps the pooled state to its labels (``pooling_head``); embedding
        # (--task embed) pools the token states without it.
        head = None
        if self.task == "score":
            head = getattr(self.model, "pooling_head", None)
            if head is None:
                raise ConfigError(f"--task score: the model plugin for {arch} has no classification head "
                                  "(pooling_head; a *ForSequenceClassification checkpoint has one); accepted for it: "
                                  "--task embed or generate")
            config = getattr(self.model, "score_pooling", None) or config
        self.pooling_config = config
        self.pooler = Pooler(config.method, config.normalize, head)
        size = getattr(self.model, "pooling_size", None) if head is not None else None
        self.embedding_size = int(size or self.hf_config.hidden_size)
        self.matryoshka = matryoshka_dimensions(self.hf_config)
        logger.info("task %s: %s pooling%s (%s), vectors of %d", self.task, config.method,
                    ", L2-normalised" if config.normalize else "", config.source, self.embedding_size)

    def pooling_info(self) -> dict[str, Any]:
        """What the tokenizer manager checks requests against (``SchedulerReady.pooling``)."""
        if self.pooling_config is None:
            return {}
        declared, sizes = self.matryoshka
        return {**self.pooling_config.to_dict(), "matryoshka": declared or self.args.enable_matryoshka,
                "matryoshka_dimensions": sizes}

    def _init_pools(self, free_before: int) -> None:
        args = self.args
        stage_layers = self.end_layer - self.start_layer
        if not self.uses_kv_cache:
            self._init_encoder_pools()
            return
        per_token = self._make_kv_pool(0, 1, stage_layers, "cpu").bytes_per_token()
        weight_bytes = self._weight_bytes()
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
            logger.info("weights: %.2f GiB", weight_bytes / 2**30)
        else:
            free_now, total = self.platform.memory_info(self.device)
            held = free_before - free_now
            # What loading left allocated beyond the weights' own bytes (allocator slack or
            # memory the device counts differently); the budget subtracts it all the same.
            logger.info("weights: %.2f GiB in their final form; device memory taken by loading: %.2f GiB",
                        weight_bytes / 2**30, held / 2**30)
            budget = self.platform.kv_cache_budget(free_before, free_now, total, weight_bytes,
                                                   args.mem_fraction_static)
            # The vision-embedding cache comes out of the same budget.
            budget -= self.mm_cache.budget_bytes
            tokens = int(max(budget, 0) // per_token)
            if self.device.type == "cpu":
                tokens = min(tokens, _CPU_MAX_POOL_TOKENS)
        page = args.page_size
        # Every rank schedules the same batches: they agree on the smallest pool any can hold.
        tokens = distributed.all_reduce_min(tokens)
        tokens = tokens // page * page
        if tokens < max(page, 16):
            raise ConfigError(self._pool_too_small(tokens, per_token, free_before))
        self.max_total_num_tokens = tokens
        max_reqs = args.max_running_requests or max(64, min(4096, tokens // 8))
        # req_to_token is [slots, context_len] int32; keep it within a fixed budget.
        max_reqs = max(1, min(max_reqs, _REQ_TO_TOKEN_BUDGET_BYTES // (4 * (self.context_len + 8))))
        self.max_running_requests = max_reqs
        # +1 slot so a request can be prefilled while max_reqs decode.
        self.req_to_token_pool = ReqToTokenPool(max_reqs + 1, self.context_len + 8, self.device)
        self.token_to_kv_pool = self._make_kv_pool(tokens, page, stage_layers, self.device)
        self.token_to_kv_pool.use_kernels(self.layer_kernels)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(tokens, page, self.device)
        logger.info("KV pool: %d tokens (%.1f MiB, %s, %d bytes per token), %d request slots", tokens,
                    tokens * per_token / 2**20, str(self.kv_cache_dtype).replace("torch.", ""), per_token, max_reqs)
        if self.token_to_kv_pool.is_fp8:
            self._log_kv_scales()

    def _init_kv_layout(self) -> None:
        """The model's KV layout (its class's ``kv_layout``): "mha", or "mla" for multi-head latent
        attention, whose model gives ``kv_lora_rank`` and ``qk_rope_head_dim``: its layers attend
        as MQA with one KV head of ``kv_lora_rank + qk_rope_head_dim`` dims (V: the leading
        ``kv_lora_rank``), so the backend and the pool get those shapes instead of the config's."""
        self.kv_layout = str(getattr(self.model, "kv_layout", "mha"))
        if self.kv_layout == "mla":
            rank, rope = int(self.model.kv_lora_rank), int(self.model.qk_rope_head_dim)
            self.num_kv_heads, self.head_dim, self.v_head_dim = 1, rank + rope, rank
        elif self.kv_layout != "mha":
            raise ConfigError(f"model {self.hf_config.architectures[0]}: kv_layout {self.kv_layout!r}; accepted: "
                              "mha, mla")

    def _make_kv_pool(self, tokens: int, page: int, layers: int, device: Any) -> Any:
        """The KV pool of the model's layout (``MLATokenToKVPool`` for "mla")."""
        if self.kv_layout == "mla":
            return MLATokenToKVPool(tokens, page, self.kv_cache_dtype, self.v_head_dim, self.head_dim - self.v_head_dim,
                                    layers, device, start_layer=self.start_layer)
        return MHATokenToKVPool(tokens, page, self.kv_cache_dtype, self.num_kv_heads, self.head_dim, layers, device,
                                start_layer=self.start_layer)

    def _init_encoder_pools(self) -> None:
        """An encoder's pools: slot bookkeeping only (the scheduler's token budget), no K/V
        buffers (a pool of zero layers)."""
        args = self.args
        tokens = args.max_total_tokens or 4 * max(args.max_prefill_tokens, self.context_len)
        tokens = max(tokens // args.page_size * args.page_size, args.page_size)
        self.max_total_num_tokens = tokens
        max_reqs = args.max_running_requests or max(64, min(4096, tokens // 8))
        self.max_running_requests = max_reqs
        self.req_to_token_pool = ReqToTokenPool(max_reqs + 1, self.context_len + 8, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(tokens, args.page_size, self.kv_cache_dtype, self.num_kv_heads,
                                                 self.head_dim, 0, self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(tokens, args.page_size, self.device)
        logger.info("encoder model: no KV cache; %d token slots, %d request slots", tokens, max_reqs)

    def _log_kv_scales(self) -> None:
        from engine.layers.radix_attention import RadixAttention

        layers = [m for m in self.model.modules() if isinstance(m, RadixAttention)]
        scaled = [m for m in layers if (m.k_scale, m.v_scale) != (1.0, 1.0)]
        if scaled:
            ks, vs = [m.k_scale for m in scaled], [m.v_scale for m in scaled]
            logger.info("fp8 KV cache: scales from the checkpoint on %d of %d layers (k %.3g..%.3g, v %.3g..%.3g)",
                        len(scaled), len(layers), min(ks), max(ks), min(vs), max(vs))
        else:
            logger.info("fp8 KV cache: the checkpoint has no k_scale/v_scale; every scale is 1.0")

    def _weight_bytes(self) -> int:
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    def _pool_too_small(self, tokens: int, per_token: int, free_at_start: int) -> str:
        """The error names both ways to size the pool, as a CLI flag and as an Engine keyword."""
        if self.args.max_total_tokens is not None:
            source = f"--max-total-tokens {self.args.max_total_tokens}"
        else:
            fraction = self.args.mem_fraction_static
            source = (f"--mem-fraction-static {fraction}" if fraction is not None else "the platform's default share")
            source += (f" of {free_at_start / 2**30:.2f} GiB available at start, weights "
                       f"{self._weight_bytes() / 2**30:.2f} GiB")
        return (f"KV pool too small: {tokens} tokens ({per_token} bytes per token) from {source}; accepted: at least "
                f"{max(self.args.page_size, 16)} tokens. Set the size with --max-total-tokens N "
                f"(Engine(max_total_tokens=N)) or raise --mem-fraction-static F (Engine(mem_fraction_static=F))")

    def _create_attention_backend(self) -> Any:
        chosen = self.selection.attention  # checked against the platform and page size already
        self.attention_backend_name = chosen.name
        ctx = AttentionContext(
            device=self.device, dtype=self.dtype, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            page_size=self.args.page_size, max_context_len=self.context_len,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
            options=dict(chosen.options),
        )
        return resolve_factory(chosen.spec.factory)(ctx)

    # -- execution ----------------------------------------------------------
    def prepare(self, forward_batch: ForwardBatch) -> None:
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        forward_batch.attn_backend = self.attn_backend
        if self.lora is not None:
            self._prepare_lora(forward_batch)

    def _prepare_lora(self, forward_batch: ForwardBatch, graph: bool = False) -> None:
        """The batch's adapter slots for every LoRA layer (``ForwardBatch.lora_uids``)."""
        assert self.lora is not None
        graphs = getattr(self, "cuda_graph_runner", None)
        static = graphs is not None and forward_batch.input_ids.data_ptr() == graphs.input_ids.data_ptr()
        if self._lora_capturing or static:
            # A graph's own static batch (capture): its rows' slots are in the static buffers,
            # which ``prepare(graph=True)`` refills before every replay.
            self.lora.state.batch_info = self.lora.static_info(forward_batch.batch_size)
            return
        rows = forward_batch.extend_seq_lens_cpu if forward_batch.forward_mode.is_extend() else None
        if forward_batch.forward_mode.is_mixed() and rows is not None:
            rows = list(rows) + [1] * (forward_batch.batch_size - len(rows))
        self.lora.prepare(forward_batch.lora_uids, rows or [1] * forward_batch.batch_size, graph=graph)

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Runs the model; with pipeline parallelism, this stage's part of it.

        A stage other than the first receives the previous stage's hidden states first; one
        other than the last sends its own on and returns logits of None (the last stage samples,
        ``sample`` shares the result).
        """
        if self.capture_hidden is not None and forward_batch.capture_hidden is None:
            forward_batch.capture_hidden = self.capture_hidden
        graphs = self.cuda_graph_runner
        if graphs is not None and graphs.can_run(forward_batch):
            if self.lora is not None:
                self._prepare_lora(forward_batch, graph=True)
            return graphs.replay(forward_batch)
        if self.placement.pp_size > 1:
            return self._forward_stage(forward_batch)
        self.prepare(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        positions = forward_batch.positions
        if self.multimodal:
            positions = self._prepare_multimodal(forward_batch)
        return self.model(forward_batch.input_ids, positions, forward_batch)

    def _prepare_multimodal(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """A multimodal model's prefill runs on input embeddings built here (text embeddings with
        the items' rows); M-RoPE models get ``[3, T]`` positions."""
        from engine.multimodal.runtime import build_input_embeds

        if forward_batch.mm_rows is not None and forward_batch.input_embeds is None:
            forward_batch.input_embeds = build_input_embeds(self.model, forward_batch, self.mm_cache)
        if forward_batch.mrope_positions is not None:
            return forward_batch.mrope_positions
        return forward_batch.positions

    @torch.inference_mode()
    def forward_hidden(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Runs a pooling model's prefill: ``[num_tokens, hidden]`` final token states."""
        self.prepare(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward_hidden(forward_batch.input_ids, forward_batch.positions, forward_batch)

    def _forward_stage(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """This pipeline stage's part of the forward, in micro-batches.

        The batch's rows are split into up to ``pp_size`` micro-batches. A stage receives each
        micro-batch's hidden states from the previous stage, runs its layers, and sends the result
        on without waiting (``isend``), so while stage ``s`` runs micro-batch ``k``, stage ``s + 1``
        runs micro-batch ``k - 1``. The last stage concatenates the micro-batches' logits; the
        other stages return logits of None (``sample`` shares the last stage's result).
        """
        from engine.layers.pipeline import PPProxyTensors

        hidden_size = self.hf_config.hidden_size
        outputs, sends = [], []
        for sub in forward_batch.split_rows(self.placement.pp_size):
            self.prepare(sub)
            self.attn_backend.init_forward_metadata(sub)
            if not distributed.is_first_pp_rank():
                hidden, residual = distributed.pp_recv([(sub.num_tokens, hidden_size)] * 2, self.dtype,
                                                       self.device)
                sub.pp_proxy = PPProxyTensors(hidden, residual)
            out = self.model(sub.input_ids, sub.positions, sub)
            if isinstance(out, PPProxyTensors):
                residual = out.residual if out.residual is not None else torch.zeros_like(out.hidden_states)
                sends.append(distributed.pp_isend([out.hidden_states, residual]))
            else:
                outputs.append(out)
        for pending in sends:
            pending.wait()
        if outputs:
            fulls = [o.full_logits for o in outputs]
            out = LogitsProcessorOutput(
                next_token_logits=torch.cat([o.next_token_logits for o in outputs]),
                full_logits=torch.cat(fulls) if all(f is not None for f in fulls) else None)  # type: ignore[arg-type]
        else:
            out = LogitsProcessorOutput(next_token_logits=None)  # type: ignore[arg-type]
        if forward_batch.return_logprob and forward_batch.forward_mode.is_extend():
            # Prompt logprobs are read on every rank (rank 0 reports them): share the last stage's.
            full = out.full_logits.cpu() if out.full_logits is not None else None
            full = distributed.broadcast_objects(full, src=distributed.last_stage_rank())
            out.full_logits = full.to(self.device) if full is not None else None
        return out

    @torch.inference_mode()
    def forward_micro_batch(self, forward_batch: ForwardBatch) -> StageLaunch:
        """This stage's part of one scheduler micro-batch (pipeline parallelism), not split further.

        A stage other than the first receives the micro-batch's hidden states and residual from
        the previous stage; one other than the last sends its own on without waiting and returns
        at once, so it can take the next micro-batch while later stages run this one. The last
        stage returns the logits (``share_sample`` samples them).
        """
        from engine.layers.pipeline import PPProxyTensors

        self.prepare(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        if not distributed.is_first_pp_rank():
            hidden, residual = distributed.pp_recv([(forward_batch.num_tokens, self.hf_config.hidden_size)] * 2,
                                                   self.dtype, self.device)
            forward_batch.pp_proxy = PPProxyTensors(hidden, residual)
        out = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        forward_batch.pp_proxy = None
        if isinstance(out, PPProxyTensors):
            residual = out.residual if out.residual is not None else torch.zeros_like(out.hidden_states)
            return StageLaunch(logits=None, sends=distributed.pp_isend([out.hidden_states, residual]))
        return StageLaunch(logits=out, sends=None)

    @torch.inference_mode()
    def share_sample(self, launch: StageLaunch, forward_batch: ForwardBatch) -> PendingSample:
        """Samples a micro-batch on the last stage and sends the result to every other rank.

        Tensor-parallel rank 0 of the last stage samples (the lockstep rule: one rank's ids
        decide) and sends the ids, logprobs and, when prompt logprobs are wanted, the full
        logits, to every other rank of the replica without waiting. Every other rank gets a
        result that receives them when read (``PendingSample.get``), which the scheduler does
        only when it processes that micro-batch, ``pp_size - 1`` micro-batches later.
        """
        src = distributed.last_stage_rank()
        placement = self.placement
        if placement.rank != src:
            return PendingSample(src=src)
        info = forward_batch.sampling_info
        assert launch.logits is not None and info is not None
        out = self.sampler(launch.logits.next_token_logits, info)
        out = SampleOutput(*(t.cpu() if t is not None else None for t in (
            out.next_token_ids, out.next_token_logprobs, out.top_logprobs, out.top_logprob_ids)))
        full = launch.logits.full_logits
        full = full.cpu() if full is not None and forward_batch.return_logprob else None
        others = [r for r in range(placement.world_size) if r != src]
        sends = distributed.isend_objects((out, full), others, distributed.TAG_SAMPLES)
        return PendingSample(src=src, result=(out, full), sends=sends)

    @torch.inference_mode()
    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> SampleOutput:
        """Samples the next tokens; every rank returns the same ids.

        Tensor-parallel ranks hold identical logits after the LM head's gather, but sampling is
        not trusted to be bit-identical everywhere (kernels, random streams), so rank 0 of the
        group samples and broadcasts its ids. With pipeline parallelism the last stage samples
        and its whole result (ids and logprobs) goes to every rank.
        """
        info = forward_batch.sampling_info
        assert info is not None
        if self.placement.pp_size > 1:
            return self._sample_from_last_stage(logits_output, info)
        out = self.sampler(logits_output.next_token_logits, info)
        if self.placement.tp_size > 1:
            distributed.tensor_model_parallel_broadcast(out.next_token_ids)
        return out

    def _sample_from_last_stage(self, logits_output: LogitsProcessorOutput, info: Any) -> SampleOutput:
        out = None
        if distributed.is_last_pp_rank():
            out = self.sampler(logits_output.next_token_logits, info)
            out = SampleOutput(*(t.cpu() if t is not None else None for t in (
                out.next_token_ids, out.next_token_logprobs, out.top_logprobs, out.top_logprob_ids)))
        out = distributed.broadcast_objects(out, src=distributed.last_stage_rank())
        return SampleOutput(*(t.to(self.device) if t is not None else None for t in (
            out.next_token_ids, out.next_token_logprobs, out.top_logprobs, out.top_logprob_ids)))
