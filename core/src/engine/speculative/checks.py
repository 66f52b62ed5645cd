"""Start-up checks of the speculative-decoding flags: what is not supported is refused here,
with one line naming the flag, before any process starts."""

from __future__ import annotations

from typing import Any

from engine.errors import ConfigError, PluginError


def check_speculative_args(args: Any) -> None:
    """Raises ``ConfigError``/``PluginError`` for a speculative configuration the engine cannot run."""
    import engine.plugins as plugins

    try:
        spec = plugins.get_speculative_algorithm(args.speculative_algorithm, args.disable_plugin)
    except PluginError as exc:
        raise PluginError(f"--speculative-algorithm: {exc}") from None
    if args.speculative_num_steps < 1:
        raise ConfigError(f"--speculative-num-steps: invalid value {args.speculative_num_steps}; accepted: an integer >= 1")
    ndt = args.speculative_num_draft_tokens
    if ndt is not None and ndt < 2:
        raise ConfigError(f"--speculative-num-draft-tokens: invalid value {ndt}; accepted: an integer >= 2 "
                          "(the last accepted token and at least one draft)")
    topk = args.speculative_eagle_topk
    if topk < 1:
        raise ConfigError(f"--speculative-eagle-topk: invalid value {topk}; accepted: an integer >= 1")
    if topk > 1 and "tree" not in spec.draft_shapes:
        raise ConfigError(f"--speculative-eagle-topk: invalid value {topk} for --speculative-algorithm {spec.name}, "
                          f"which drafts chains only (draft_shapes={spec.draft_shapes!r}); accepted: 1")
    if args.speculative_max_batch_size < 1:
        raise ConfigError(f"--speculative-max-batch-size: invalid value {args.speculative_max_batch_size}; "
                          "accepted: an integer >= 1")
    unsupported = [
        (args.tp_size > 1 and spec.needs_draft_model, f"--tp-size {args.tp_size}",
         "--tp-size 1 for a proposer with a model of its own (ngram works with tensor parallelism)"),
        (args.pp_size > 1, f"--pp-size {args.pp_size}", "--pp-size 1"),
        (args.page_size > 1, f"--page-size {args.page_size}", "--page-size 1"),
    ]
    for bad, what, accepted in unsupported:
        if bad:
            raise ConfigError(f"--speculative-algorithm {args.speculative_algorithm}: not supported with {what}; "
                              f"accepted: {accepted}")
    if spec.needs_draft_model and not args.speculative_draft_model_path:
        raise ConfigError(f"--speculative-draft-model-path: required by --speculative-algorithm {spec.name}")
