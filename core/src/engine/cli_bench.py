"""``engine bench``: one-batch, offline, serving (SGLang-compatible flags and metrics), startup."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import typing
from typing import Any, Optional

import typer

from engine.cli_args import _opt, fail, with_server_args
from engine.config import ServerArgs

bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="Benchmarks: one-batch, offline, serving, multi-turn, startup, spec, scheduler, vision; random-lora writes "
                             "adapters to benchmark with; report writes the benchmarks page.")


_LORA_NAME = _opt("lora_name", Optional[list[str]], None, "--lora-name",
                  help="LoRA adapters of --lora-paths the requests run with, round-robin over the batch "
                       "(batch 64 over 8 names: 8 distinct adapters); several after one flag")


def _check_lora_names(server_args: ServerArgs, names: list[str] | None) -> None:
    """Every --lora-name is one of the --lora-paths adapters (checked before anything loads)."""
    for name in names or ():
        if name not in server_args.lora_paths:
            loaded = ", ".join(server_args.lora_paths) or "none (pass --lora-paths NAME=DIR ...)"
            fail(f"--lora-name: invalid value {name!r}; accepted: the --lora-paths adapters: {loaded}")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        fail(f"{flag}: invalid value {text!r}; expected integers separated by spaces or commas")
    if not values or min(values) < 1:
        fail(f"{flag}: invalid value {text!r}; expected integers >= 1")
    return values


@bench_app.command("one-batch")
@with_server_args([
    _opt("batch_size", str, "1", "--batch-size", help="Batch sizes, e.g. '1 8 64'"),
    _opt("input_len", str, "1024", "--input-len", help="Prompt lengths"),
    _opt("output_len", str, "16", "--output-len", help="Generated tokens"),
    _opt("result_file", Optional[str], None, "--result-file", help="Append JSON lines here"),
    _opt("json_schema", Optional[str], None, "--json-schema",
         help="Decode every request under this JSON Schema file ('' = a built-in schema), with --grammar-backend"),
    _LORA_NAME,
])
def one_batch_cmd(server_args: ServerArgs, batch_size: str, input_len: str, output_len: str,
                  result_file: str | None, json_schema: str | None, lora_name: list[str] | None) -> None:
    """Static-batch latency: prefill, then median decode step, for each size combination."""
    from engine.bench.json_schema import load_bench_schema

    # Flags are checked before the benchmark (and torch) is imported: a typo answers at once.
    sizes = _ints(batch_size, "--batch-size"), _ints(input_len, "--input-len"), _ints(output_len, "--output-len")
    _check_lora_names(server_args, lora_name)
    # One batch is one forward: its requests' distinct adapters must fit the adapter slots. Request
    # i runs lora_name[i % len] (round-robin), so the largest batch uses the first so many names.
    distinct = len(set((lora_name or [])[:max(sizes[0])]))
    if distinct > server_args.max_loras_per_batch:
        fail(f"--lora-name: {distinct} distinct adapters in a batch of {max(sizes[0])}; accepted: at most "
             f"--max-loras-per-batch ({server_args.max_loras_per_batch}) in one-batch, which runs each batch as one forward")
    try:
        schema = load_bench_schema(json_schema)
    except (OSError, ValueError) as exc:
        fail(f"--json-schema: cannot read {json_schema!r}: {exc}")
    from engine.managers.process_utils import setup_child_logging

    # The model loads in this process: its start-up lines (the GGUF converted or found in the
    # cache, the weights, the KV pool) go to stderr, so a first run is not minutes of silence.
    setup_child_logging(server_args.log_level, "bench")
    from engine.bench.one_batch import bench_one_batch

    bench_one_batch(server_args, *sizes, result_file, json_schema=schema, lora_names=lora_name)


_DATASET_OPTS = [
    _opt("dataset_name", str, "random", "--dataset-name", help="random | sharegpt-file | generated-shared-prefix"),
    _opt("dataset_path", Optional[str], None, "--dataset-path", help="ShareGPT JSON file (sharegpt-file)"),
    _opt("num_prompts", int, 1000, "--num-prompts", help="Requests to run"),
    _opt("random_input_len", int, 1024, "--random-input-len", help="Longest random prompt"),
    _opt("random_output_len", int, 1024, "--random-output-len", help="Longest random output"),
    _opt("random_range_ratio", float, 0.0, "--random-range-ratio", help="Lengths drawn in [len*ratio, len]"),
    _opt("gsp_num_groups", int, 64, "--gsp-num-groups", help="Shared system prompts"),
    _opt("gsp_prompts_per_group", int, 16, "--gsp-prompts-per-group", help="Questions per system prompt"),
    _opt("gsp_system_prompt_len", int, 2048, "--gsp-system-prompt-len", help="System prompt tokens"),
    _opt("gsp_question_len", int, 128, "--gsp-question-len", help="Question tokens"),
    _opt("gsp_output_len", int, 256, "--gsp-output-len", help="Output tokens"),
    _opt("seed", int, 1, "--seed", help="Dataset seed"),
]


@bench_app.command("spec")
@with_server_args([
    _opt("batch_size", int, 1, "--batch-size", help="Requests run at once"),
    _opt("output_len", int, 256, "--output-len", help="Generated tokens per request (greedy, EOS ignored)"),
    _opt("workload", str, "copy", "--workload",
         help="copy: the model quotes a passage of its prompt back (needs its tokenizer); "
              "random: --input-len random token ids per request (no tokenizer: runs with --load-format dummy "
              "--skip-tokenizer-init)"),
    _opt("passages", int, 2, "--passages", help="copy: times the ~230-word passage appears in the prompt"),
    _opt("input_len", Optional[int], None, "--input-len", help="random: prompt tokens per request (default 512)"),
    _opt("seed", int, 1, "--seed", help="random: seed of the prompts"),
    _opt("ceiling", bool, False, "--ceiling/--no-ceiling",
         help="Run the batch plain, then with drafts = the plain run's own next tokens (k = --speculative-num-steps, "
              "all accepted): the mechanism's ceiling and the verify step's cost against a decode step"),
    _opt("result_file", Optional[str], None, "--result-file", help="Append a JSON line here"),
])
def spec_cmd(server_args: ServerArgs, batch_size: int, output_len: int, workload: str, passages: int,
             input_len: int | None, seed: int, ceiling: bool, result_file: str | None) -> None:
    """Decode speed of a batch, with the speculation the flags set (compare with and without
    --speculative-algorithm, or --ceiling): tok/s, mean step time, mean acceptance length."""
    from engine.bench.spec import SpecWorkload, bench_spec

    if input_len is not None and workload != "random":
        fail(f"--input-len: applies to --workload random only (the copy prompt's length is set by --passages); "
             f"got --workload {workload!r}")
    work = SpecWorkload(batch_size=batch_size, output_len=output_len, workload=workload, passages=passages,
                        input_len=512 if input_len is None else input_len, seed=seed, ceiling=ceiling)
    try:
        work.check(server_args)
    except ValueError as exc:
        fail(str(exc))
    bench_spec(server_args, work, result_file)


@bench_app.command("startup")
@with_server_args([
    _opt("rounds", int, 3, "--rounds", help="Rounds of floor / Engine / engine serve, alternated"),
    _opt("mode", str, "generate serve", "--mode", help="What to time besides the floor: 'generate', 'serve' or both"),
    _opt("result_file", Optional[str], None, "--result-file", help="Append a JSON line here"),
])
def startup_cmd(server_args: ServerArgs, rounds: int, mode: str, result_file: str | None) -> None:
    """Seconds to the first answer (Engine and engine serve) against the import floor."""
    from engine.bench.startup import bench_startup, format_summary

    modes = mode.replace(",", " ").split()
    if not modes or any(m not in ("generate", "serve") for m in modes):
        fail(f"--mode: invalid value {mode!r}; accepted: generate, serve, or both")
    if rounds < 1:
        fail(f"--rounds: invalid value {rounds}; accepted: >= 1")
    try:
        result = bench_startup(server_args, rounds, modes)
    except RuntimeError as exc:
        fail(str(exc))
    typer.echo(format_summary(result))
    import os
    import platform

    from engine.bench.results import append_rows

    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    append_rows(result_file, {"bench": "startup", "machine": machine, **result.to_dict()})


@bench_app.command("cpu-compare")
@with_server_args([
    _opt("batch_size", str, "1 8", "--batch-size", help="Batch sizes (llama.cpp runs batch 1 only)"),
    _opt("input_len", int, 128, "--input-len", help="Prompt length"),
    _opt("output_len", int, 64, "--output-len", help="Generated tokens"),
    _opt("rounds", int, 3, "--rounds", help="Rounds of engine / transformers / llama.cpp, back to back"),
    _opt("result_file", Optional[str], None, "--result-file", help="Append JSON lines here"),
])
def cpu_compare_cmd(server_args: ServerArgs, batch_size: str, input_len: int, output_len: int, rounds: int,
                    result_file: str | None) -> None:
    """CPU decode rate and TTFT: engine vs transformers generate vs llama.cpp on one GGUF."""
    sizes = _ints(batch_size, "--batch-size")
    for flag, value, least in (("--input-len", input_len, 1), ("--output-len", output_len, 2), ("--rounds", rounds, 1)):
        if value < least:
            fail(f"{flag}: invalid value {value}; accepted: >= {least}")
    from engine.bench.cpu_compare import bench_cpu_compare

    try:
        bench_cpu_compare(server_args, sizes, input_len, output_len, rounds, result_file)
    except ValueError as exc:
        fail(str(exc))


@bench_app.command("offline")
@with_server_args(_DATASET_OPTS + [
    _opt("result_file", Optional[str], None, "--result-file", help="Append a JSON line here"),
    _LORA_NAME,
])
def offline_cmd(server_args: ServerArgs, result_file: str | None, lora_name: list[str] | None,
                **dataset: Any) -> None:
    """Offline throughput of the whole Engine on a dataset (every request submitted at once)."""
    from engine.bench.datasets import DATASET_NAMES, DatasetArgs
    from engine.bench.offline import bench_offline

    _check_lora_names(server_args, lora_name)
    if dataset["dataset_name"] not in DATASET_NAMES:
        fail(f"--dataset-name: invalid value {dataset['dataset_name']!r}; accepted: {', '.join(DATASET_NAMES)}")
    try:
        data = DatasetArgs(**dataset)
        bench_offline(server_args, data, result_file, lora_names=lora_name)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))


def _serving_params() -> list[inspect.Parameter]:
    from engine.bench.serving_args import BenchServingArgs

    hints = typing.get_type_hints(BenchServingArgs)
    params = []
    for f in dataclasses.fields(BenchServingArgs):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = typing.get_origin(args[0] if args else hint) or (args[0] if args else hint)
        flag = "--" + f.name.replace("_", "-")
        if base is bool:
            ann: Any = bool
            decls = [f"{flag}/--no-{flag[2:]}"]
        elif base is list:  # several values after one flag (split_multi_value_flags) or one per use
            ann, decls = Optional[list[str]], [flag]
        elif base in (int, float, str):
            ann = Optional[base] if type(None) in typing.get_args(hint) else base
            decls = [flag]
        else:  # dicts arrive as JSON text
            ann, decls = Optional[str], [flag]
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, float) and math.isinf(default):
            ann, default = str, "inf"
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=ann,
                                        default=typer.Option(default, *decls)))
    return params


def serving_cmd(**kwargs: Any) -> None:
    """Online serving benchmark against any OpenAI-compatible or /generate server."""
    from engine.bench.serving import benchmark_serving
    from engine.bench.serving_args import BenchServingArgs

    try:
        rate = kwargs.get("request_rate")
        if isinstance(rate, str):
            kwargs["request_rate"] = float(rate)
        if isinstance(kwargs.get("extra_request_body"), str):
            kwargs["extra_request_body"] = json.loads(kwargs["extra_request_body"])
        benchmark_serving(BenchServingArgs(**kwargs))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        fail(str(exc))


serving_cmd.__signature__ = inspect.Signature(_serving_params())  # type: ignore[attr-defined]
bench_app.command("serving")(serving_cmd)


@bench_app.command("multi-turn")
def multi_turn_cmd(
    base_url: Optional[str] = typer.Option(None, "--base-url", help="Server root, e.g. http://10.0.0.5:30000"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(30000, "--port"),
    num_conversations: int = typer.Option(16, "--num-conversations", help="Conversations"),
    num_turns: int = typer.Option(4, "--num-turns", help="Turns of each conversation"),
    history_len: int = typer.Option(2048, "--history-len", help="Random token ids each conversation starts with"),
    turn_input_len: int = typer.Option(128, "--turn-input-len", help="Token ids of each new user message"),
    output_len: int = typer.Option(64, "--output-len", help="Tokens each answer generates"),
    max_concurrency: int = typer.Option(8, "--max-concurrency", help="Turns in flight at most"),
    request_rate: str = typer.Option("inf", "--request-rate", help="Turns started per second at most (inf: no limit)"),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="Ids to draw from (default: the server's)"),
    seed: int = typer.Option(1, "--seed"),
    flush_cache: bool = typer.Option(True, "--flush-cache/--no-flush-cache",
                                     help="Empty the server's prefix cache before the run"),
    result_file: Optional[str] = typer.Option(None, "--result-file", help="Append a JSON line here"),
) -> None:
    """Multi-turn conversations against a running server: each turn resends the whole
    conversation, turns go round-robin over the conversations (prefix reuse, KV cache tiers)."""
    try:
        rate = float(request_rate)
    except ValueError:
        fail(f"--request-rate: invalid value {request_rate!r}; accepted: a number > 0 or inf")
    from engine.bench.multi_turn import MultiTurnArgs, bench_multi_turn

    args = MultiTurnArgs(base_url=base_url, host=host, port=port, num_conversations=num_conversations,
                         num_turns=num_turns, history_len=history_len, turn_input_len=turn_input_len,
                         output_len=output_len, max_concurrency=max_concurrency, request_rate=rate,
                         vocab_size=vocab_size, seed=seed, flush_cache=flush_cache, result_file=result_file)
    try:
        args.validate()
        bench_multi_turn(args)
    except (ValueError, RuntimeError, OSError) as exc:
        fail(str(exc))


@bench_app.command("vision")
@with_server_args([
    _opt("image_count", int, 1, "--image-count", help="Images in the prompt"),
    _opt("image_resolution", str, "1024x1024", "--image-resolution", help="Their size, WIDTHxHEIGHT (random pixels)"),
    _opt("text_words", int, 16, "--text-words", help="Words of text after the images"),
    _opt("reps", int, 5, "--reps", help="Timed runs of each measurement (medians reported)"),
    _opt("result_file", Optional[str], None, "--result-file", help="Append a JSON line here"),
])
def vision_cmd(server_args: ServerArgs, image_count: int, image_resolution: str, text_words: int, reps: int,
               result_file: str | None) -> None:
    """A vision-language model's image prefill: the vision encoder's time and share, against a
    text-only prefill of the same token count."""
    from engine.bench.images import parse_resolution

    try:
        parse_resolution(image_resolution)
    except ValueError as exc:
        fail(str(exc))
    for flag, value, least in (("--image-count", image_count, 1), ("--text-words", text_words, 0), ("--reps", reps, 1)):
        if value < least:
            fail(f"{flag}: invalid value {value}; accepted: >= {least}")
    from engine.managers.process_utils import setup_child_logging

    setup_child_logging(server_args.log_level, "bench")
    from engine.bench.vision import bench_vision

    try:
        bench_vision(server_args, image_count, image_resolution, text_words, reps, result_file)
    except ValueError as exc:
        fail(str(exc))


@bench_app.command("random-lora")
def random_lora_cmd(
    model_path: str = typer.Option(..., "--model-path", help="Base model directory (its config.json; weights not needed)"),
    output: str = typer.Option(..., "--output", help="Directory to write the adapters in (one subdirectory each)"),
    rank: int = typer.Option(16, "--rank", help="LoRA rank"),
    num: int = typer.Option(8, "--num", help="Adapters to write"),
    targets: str = typer.Option("all", "--targets", help="Target modules, e.g. 'q_proj v_proj', or all seven"),
    seed: int = typer.Option(0, "--seed", help="Seed of the first adapter (the next ones count up)"),
) -> None:
    """Random PEFT adapters for a model's shape (benchmarks on --load-format dummy); prints the
    --lora-paths arguments that load them."""
    import os

    from engine.config import LORA_TARGET_MODULES

    modules = list(LORA_TARGET_MODULES) if targets.strip() == "all" else targets.replace(",", " ").split()
    bad = [m for m in modules if m not in LORA_TARGET_MODULES]
    if bad or not modules:
        fail(f"--targets: invalid value {targets!r}; accepted: all, or some of {' '.join(LORA_TARGET_MODULES)}")
    for flag, value in (("--rank", rank), ("--num", num)):
        if value < 1:
            fail(f"{flag}: invalid value {value}; accepted: >= 1")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        fail(f"--model-path: cannot read a config from {model_path!r}: {exc}")
    config = getattr(config, "text_config", None) or config
    from engine.lora.adapter import write_random_adapter

    paths = []
    for i in range(num):
        path = os.path.join(output, f"lora{i}")
        write_random_adapter(config, path, rank, modules, seed=seed + i)
        paths.append(f"lora{i}={path}")
    typer.echo(" ".join(paths))


@bench_app.command("scheduler")
def scheduler_cmd(
    running: str = typer.Option("64 256 1024", "--running-requests", help="Running-batch sizes to time"),
    result_file: Optional[str] = typer.Option(None, "--result-file", help="Append JSON lines here"),
) -> None:
    """Scheduler and radix-cache CPU overhead with a null model (no device needed)."""
    from engine.bench.scheduler_bench import bench_scheduler

    bench_scheduler(_ints(running, "--running-requests"), result_file)


@bench_app.command("report")
def report_cmd(
    results: list[str] = typer.Argument(..., help="Result files (JSON lines), e.g. docs/bench_results/*.jsonl"),
    output: Optional[str] = typer.Option(None, "--output", help="Write the page here (default: print it)"),
    check: bool = typer.Option(False, "--check", help="Exit 1 if --output differs from the page the files give"),
) -> None:
    """The benchmarks page (docs/benchmarks.md) from result files: per area, the newest row of each
    configuration and device."""
    from pathlib import Path

    from engine.bench.report import ReportError, build_page

    if check and not output:
        fail("--check: needs --output PAGE (the file to compare with)")
    try:
        page = build_page(results)
    except ReportError as exc:
        fail(str(exc))
    if not output:
        typer.echo(page, nl=False)
        return
    target = Path(output)
    if check:
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if current != page:
            typer.echo(f"{output} is out of date with {len(results)} result file(s); regenerate: engine bench report "
                       f"{' '.join(results)} --output {output}", err=True)
            raise typer.Exit(1)
        typer.echo(f"{output} is up to date")
        return
    target.write_text(page, encoding="utf-8")
    typer.echo(f"wrote {output}")
