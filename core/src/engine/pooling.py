"""What a pooling (prefill-only) model serves and how it pools: read without torch.

``resolve_task`` picks ``generate``, ``embed`` or ``score`` from ``--task`` and the checkpoint's
architecture; ``read_pooling_config`` reads sentence-transformers' files beside the checkpoint
(``modules.json``, ``1_Pooling/config.json``, ``config_sentence_transformers.json``) or falls back
to the default of the architecture. The pooling itself runs in ``engine.layers.pooler``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError

# Architectures without a language-model head that are served as embedding models.
ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM")
POOLING_METHODS = ("cls", "mean", "last", "max")
TASKS = ("generate", "embed", "score")


def default_task(architecture: str) -> str:
    """The task an architecture is served for when ``--task`` is auto."""
    if architecture.endswith("ForSequenceClassification") or architecture.endswith("ForRewardModel"):
        return "score"
    if architecture in ENCODER_ARCHITECTURES or architecture.endswith("Model"):
        return "embed"
    return "generate"


def resolve_task(task: str, architecture: str) -> str:
    """``--task`` with ``auto`` resolved; an encoder asked to generate is a ConfigError."""
    if task == "auto":
        return default_task(architecture)
    if task not in TASKS:
        raise ConfigError(f"--task: invalid value {task!r}; accepted: auto, {', '.join(TASKS)}")
    if task == "generate" and default_task(architecture) != "generate":
        raise ConfigError(f"--task generate: architecture {architecture} has no language-model head; "
                          f"accepted for it: {default_task(architecture)}")
    return task


def check_task(args: Any, hf_config: Any) -> str:
    """Start-up check of ``--task`` against the checkpoint (``entrypoints.launch.preflight``):
    the resolved task; a pooling task with pipeline parallelism, speculative decoding or an
    architecture that cannot generate asked to is a ConfigError naming the flag."""
    task = resolve_task(args.task, hf_config.architectures[0])
    if task == "generate":
        if args.enable_matryoshka:
            raise ConfigError("--enable-matryoshka: applies to embedding models only (--task embed)")
        return task
    if args.pp_size > 1:
        raise ConfigError(f"--pp-size: invalid value {args.pp_size} with --task {task}; accepted: 1 (pooling "
                          "models run whole on each rank)")
    if args.speculative_algorithm:
        raise ConfigError(f"--speculative-algorithm: not accepted with --task {task} (pooling models generate "
                          "no tokens)")
    return task


@dataclass(frozen=True)
class PoolingConfig:
    """How one request's token hidden states become its vector."""

    # "cls": the first token's state; "mean"/"max": over every token; "last": the last token's.
    method: str
    # L2-normalise the vector (after any ``dimensions`` truncation).
    normalize: bool
    # Where the settings came from, for the start-up log and /get_server_info.
    source: str
    # config_sentence_transformers.json's truncate_dim: the size returned when a request names none.
    default_dimensions: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "normalize": self.normalize, "source": self.source,
                "default_dimensions": self.default_dimensions}


def default_pooling(architecture: str, encoder: bool | None = None) -> PoolingConfig:
    """Encoders: mean pooling, as sentence-transformers builds for a plain checkpoint; decoders:
    the last token, as Qwen3-Embedding and gte-Qwen do; both L2-normalised.

    ``encoder``: whether the model attends both ways (its class declares ``uses_kv_cache = False``);
    None decides from the architecture, where every ``Bert*`` class is an encoder (the last token
    of a BERT prompt is ``[SEP]``, whose state is not the text's vector).
    """
    if encoder is None:
        encoder = architecture in ENCODER_ARCHITECTURES or architecture.startswith("Bert")
    if encoder:
        return PoolingConfig("mean", True, f"default for encoder {architecture}")
    return PoolingConfig("last", True, f"default for {architecture}")


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model-path: cannot read {path}: {exc}") from None


_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max"}
_ST_UNSUPPORTED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def read_pooling_config(model_dir: str, architecture: str, encoder: bool | None = None) -> PoolingConfig:
    """The checkpoint's sentence-transformers pooling, else ``default_pooling(architecture, encoder)``.

    ``modules.json`` lists the modules after the transformer: a ``Pooling`` module (its folder's
    ``config.json`` names the mode) and optionally ``Normalize``. A module this engine does not run
    (``Dense`` projections and the like) is a ConfigError rather than vectors that differ from the
    model's.
    """
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return default_pooling(architecture, encoder)
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ConfigError(f"--model-path: {modules_path}: expected a list of modules")
    method: str | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            method = _pooling_mode(os.path.join(model_dir, str(module.get("path", "")), "config.json"))
        else:
            raise ConfigError(f"--model-path: {modules_path} has a sentence-transformers module of type "
                              f"{module.get('type')!r}; supported: Transformer, Pooling, Normalize")
    if method is None:
        raise ConfigError(f"--model-path: {modules_path} has no Pooling module")
    truncate = None
    st_config = os.path.join(model_dir, "config_sentence_transformers.json")
    if os.path.isfile(st_config):
        value = _read_json(st_config).get("truncate_dim")
        truncate = int(value) if isinstance(value, int) and value > 0 else None
    return PoolingConfig(method, normalize, "sentence-transformers modules.json", truncate)


def _pooling_mode(path: str) -> str:
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ConfigError(f"--model-path: {path}: expected a mapping")
    on = [key for key, value in data.items() if key.startswith("pooling_mode_") and value is True]
    bad = [key for key in on if key in _ST_UNSUPPORTED or key not in _ST_MODES]
    if bad or len(on) != 1:
        raise ConfigError(f"--model-path: {path} sets {', '.join(on) or 'no pooling mode'}; supported: exactly one "
                          f"of {', '.join(_ST_MODES)}")
    if data.get("include_prompt") is False:
        raise ConfigError(f"--model-path: {path} sets include_prompt false (instruction tokens left out of the "
                          "pool); supported: true")
    return _ST_MODES[on[0]]


def matryoshka_dimensions(hf_config: Any) -> tuple[bool, list[int] | None]:
    """Whether the checkpoint declares Matryoshka training, and its list of sizes (None: any)."""
    sizes = getattr(hf_config, "matryoshka_dimensions", None)
    if isinstance(sizes, list) and sizes:
        return True, sorted(int(s) for s in sizes)
    return bool(getattr(hf_config, "is_matryoshka", False)), None


__all__ = ["ENCODER_ARCHITECTURES", "POOLING_METHODS", "PoolingConfig", "TASKS", "check_task", "default_pooling", "default_task",
           "matryoshka_dimensions", "read_pooling_config", "resolve_task"]
