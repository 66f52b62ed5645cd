"""``engine bench report``: the benchmarks page (docs/benchmarks.md) generated from result files.

A result file is JSON lines, one measurement a line, as ``--result-file`` writes them. A row joins
the page under one area (``AREAS``) with these fields beside the benchmark's own:

- ``area``: an area id (``decode``, ``offline``, ...); inferred from the row when absent;
- ``config``: what was measured, in words; built from the row's settings when absent;
- ``command``: the command that produced it (``--result-file`` writers stamp it);
- ``device``: the device as the benchmark describes it (``machine`` for CPU-only scripts);
- ``date``: UTC, ``YYYY-MM-DD`` or ``YYYY-MM-DD HH:MM`` (stamped like ``command``);
- optional ``weight_gb``: the bytes one decode step reads per GPU (GB); the row's ratio is then
  the copy-bandwidth roofline (``weight_gb`` over the card's measured bandwidth) over its step;
- optional ``peer``: a measurement of the same run to compare with: ``{"config": "<what>", ...}``
  with the fields the figure is read from (``median_decode_latency_s``, ``us``, ...);
- optional ``figure``: which of a benchmark's figures the row shows (``prefill`` for
  ``one-batch``; the field name for ``hf-baseline``; ``throughput`` for ``serving``).

For each (area, configuration, device) the page shows the newest row only, so a new run of the
same configuration replaces the old one by being added to a file.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Area:
    key: str
    heading: str
    #: What produces a row of this area, for the line an empty area shows.
    produced_by: str


AREAS: tuple[Area, ...] = (
    Area("decode", "Decode latency", "`engine bench one-batch --batch-size \"1 64\" --result-file F`"),
    Area("offline", "Offline throughput", "`engine bench offline --result-file F`"),
    Area("serving", "Serving", "`engine bench serving --result-file F` against `engine serve`, or `scripts/soak.py`"),
    Area("kv-cache", "KV cache tiers", "`engine bench multi-turn --result-file F` against `engine serve "
         "--enable-hierarchical-cache`"),
    Area("disaggregation", "Disaggregation", "`python3 benchmarks/bench_disaggregation.py --result-file F`"),
    Area("quantization", "Quantization", "`engine bench one-batch --quant METHOD --result-file F`"),
    Area("parallelism", "Parallelism", "`engine bench one-batch --tp-size 2 --result-file F` (or `offline --dp-size 2`)"),
    Area("moe", "Mixture of experts", "`engine bench one-batch --model-path docs/bench_configs/qwen3-30b-a3b --result-file F`"),
    Area("mla", "DeepSeek (MLA)", "`engine bench one-batch --model-path docs/bench_configs/deepseek-v2-lite --result-file F`"),
    Area("speculative", "Speculative decoding", "`engine bench spec --result-file F`"),
    Area("lora", "LoRA adapters", "`engine bench one-batch --lora-paths ... --lora-name ... --result-file F`"),
    Area("vlm", "Vision-language models", "`engine bench vision --result-file F`, or `engine bench serving "
         "--dataset-name image --result-file F`"),
    Area("structured-output", "Structured output", "`engine bench one-batch --json-schema '' --result-file F`"),
    Area("cpu-default-model", "CPU default model", "`engine bench cpu-compare --result-file F`"),
    Area("startup", "Start-up", "`engine bench startup --result-file F`"),
)
AREA_KEYS = tuple(a.key for a in AREAS)

#: Measured device-to-device copy bandwidth (TB/s) by card: the roofline's denominator.
COPY_BANDWIDTH_TB_S = {"H100": 3.02, "H200": 4.29}

_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}( \d{2}:\d{2})?$")
_NVIDIA = re.compile(r"NVIDIA ([A-Z]\d+[^(,]*)")


class ReportError(ValueError):
    """A result row the page cannot use; the message names the file, line, field and value."""


@dataclass(frozen=True)
class Row:
    #: The row as read, with ``area`` and ``config`` filled in.
    fields: dict[str, Any]
    #: ``file:line``, for messages.
    source: str
    #: Its position over all files read: tables keep the files' order.
    order: int

    @property
    def area(self) -> str:
        return self.fields["area"]

    @property
    def key(self) -> tuple[str, str, str]:
        return self.area, self.fields["config"], device_name(self.fields)


@dataclass(frozen=True)
class Figure:
    #: What the table's figure cell shows.
    text: str
    #: The number ratios are taken of (None: the row has no single number to compare).
    value: float | None = None
    #: False for times: a ratio to a peer is then the peer's value over the row's.
    higher_is_better: bool = True


# -- reading ----------------------------------------------------------------------------
def read_rows(paths: Sequence[str | Path]) -> list[Row]:
    """Every row of ``paths`` (JSON lines; blank lines skipped), checked and completed."""
    rows: list[Row] = []
    for path in paths:
        path = Path(path)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ReportError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path.name}:{number}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ReportError(f"{where}: not a JSON object ({exc.msg})") from exc
            if not isinstance(data, dict):
                raise ReportError(f"{where}: not a JSON object (got {type(data).__name__})")
            rows.append(Row(complete_row(data, where), where, len(rows)))
    return rows


def bench_kind(row: dict[str, Any]) -> str:
    """The benchmark that wrote ``row`` (older writers left out ``bench``)."""
    if "bench" in row:
        return str(row["bench"])
    if "floor_s" in row:
        return "startup"
    if "mean_ttft_ms" in row:
        return "serving"
    return "unknown"


def _size(row: dict[str, Any], key: str) -> int:
    """A parallel size (``tp_size``, ...); rows from before it was recorded count as 1."""
    return int(row.get(key) or 1)


def infer_area(row: dict[str, Any]) -> str | None:
    """The area a row as a benchmark wrote it belongs to; None for a kind the page does not place."""
    kind = bench_kind(row)
    if row.get("lora_adapters") and kind in ("one-batch", "offline"):
        return "lora"
    if kind == "serving" and row.get("dataset_name") == "image":
        return "vlm"
    if kind == "one-batch":
        if row.get("json_schema"):
            return "structured-output"
        if row.get("quant"):
            return "quantization"
        if _size(row, "ep_size") > 1:
            return "moe"
        if _size(row, "tp_size") > 1 or _size(row, "pp_size") > 1:
            return "parallelism"
        return "decode"
    if kind == "offline":
        if _size(row, "dp_size") > 1 or _size(row, "tp_size") > 1:
            return "parallelism"
        return "quantization" if row.get("quant") else "offline"
    return {"spec": "speculative", "startup": "startup", "serving": "serving", "soak": "serving",
            "scheduler-decode-step": "serving", "default-model-cpu-decode": "cpu-default-model",
            "cpu-compare": "cpu-default-model", "multi-turn": "kv-cache",
            "all-reduce": "parallelism", "hf-baseline": "decode", "vision": "vlm",
            "disaggregation": "disaggregation"}.get(kind)


def infer_config(row: dict[str, Any]) -> str:
    """A configuration label from a row's own settings (when it names none)."""
    kind = bench_kind(row)
    # Rows name their model since model_path was added to them; None is the embedded default model.
    parts = [] if "model_path" not in row else [Path(row["model_path"]).name if row["model_path"] else "default model"]
    if row.get("quant"):
        parts.append(str(row["quant"]))
    if kind == "one-batch":
        parts += [str(row.get("attention", "?")), f"batch {row.get('batch_size')}",
                  f"{row.get('input_len')} in / {row.get('output_len')} out"]
        if row.get("lora_adapters"):
            parts.append(f"{row['lora_adapters']} rank-{row.get('lora_rank')} LoRA adapter"
                         f"{'s' if row['lora_adapters'] > 1 else ''} ({row.get('lora_backend')})")
        parts += [f"{k.split('_')[0].upper()}={row[k]}" for k in ("tp_size", "pp_size", "ep_size") if _size(row, k) > 1]
    elif kind == "offline":
        parts += [str(row.get("attention", "?")), f"{row.get('dataset')}, {row.get('num_prompts')} prompts"]
        if row.get("lora_adapters"):
            parts.append(f"{row['lora_adapters']} rank-{row.get('lora_rank')} LoRA adapters")
        if _size(row, "tp_size") > 1:
            parts.append(f"TP={row['tp_size']}")
        if _size(row, "dp_size") > 1:
            parts.append(f"DP={row['dp_size']}, {row.get('router_policy')}")
    elif kind == "vision":
        parts += [f"{row.get('image_count')} x {row.get('image_resolution')} image, "
                  f"{row.get('prompt_tokens')} prompt tokens ({row.get('image_tokens')} of images)"]
    elif kind == "spec":
        parts += [f"{row.get('algorithm') or 'no speculation'}, k = {row.get('num_draft_tokens', 1) - 1}",
                  f"batch {row.get('batch_size')}", f"{row.get('workload')} workload"]
    elif kind == "cpu-compare":
        parts += [str(row.get("gguf")), f"batch {row.get('batch_size')}",
                  f"{row.get('input_len')} in / {row.get('output_len')} out",
                  f"{row.get('threads')} thread{'s' if row.get('threads') != 1 else ''}"]
    elif kind == "multi-turn":
        parts += [f"{row.get('num_conversations')} conversations x {row.get('num_turns')} turns, "
                  f"{row.get('history_len')}-token histories, {row.get('turn_input_len')} in / "
                  f"{row.get('output_len')} out a turn, concurrency {row.get('max_concurrency')}"]
    elif kind == "hf-baseline":
        parts += ["Hugging Face transformers `generate`", str(row.get("figure") or "hf_eager_bs1_tok_s")]
    else:
        parts = [kind] + ([f"batch {row['batch_size']}"] if "batch_size" in row else [])
    return ", ".join(parts)


def complete_row(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` with ``area`` and ``config`` filled in where inferable; raises ``ReportError`` on a
    row the page cannot show."""
    row = dict(data)
    if "area" not in row:
        area = infer_area(row)
        if area is None:
            raise ReportError(f"{where}: no 'area' and none can be inferred from bench {bench_kind(row)!r}; "
                              f"add one of: {', '.join(AREA_KEYS)}")
        row["area"] = area
    if row["area"] not in AREA_KEYS:
        raise ReportError(f"{where}: field 'area': invalid value {row['area']!r}; accepted: {', '.join(AREA_KEYS)}")
    if "config" not in row:
        row["config"] = infer_config(row)
    for name in ("config", "command"):
        if not isinstance(row.get(name), str) or not row[name].strip():
            raise ReportError(f"{where}: field {name!r}: missing or empty (got {row.get(name)!r}); expected text")
    if not isinstance(row.get("date"), str) or not _DATE.match(row["date"]):
        raise ReportError(f"{where}: field 'date': invalid value {row.get('date')!r}; "
                          "expected UTC 'YYYY-MM-DD' or 'YYYY-MM-DD HH:MM'")
    if not (row.get("device") or row.get("machine")):
        raise ReportError(f"{where}: field 'device': missing; expected the device the row was measured on")
    if "weight_gb" in row and not (isinstance(row["weight_gb"], (int, float)) and row["weight_gb"] > 0):
        raise ReportError(f"{where}: field 'weight_gb': invalid value {row['weight_gb']!r}; expected GB > 0")
    peer = row.get("peer")
    if peer is not None and not (isinstance(peer, dict) and isinstance(peer.get("config"), str)):
        raise ReportError(f"{where}: field 'peer': invalid value {peer!r}; expected an object with a 'config' text")
    try:
        figure(row)
        if peer is not None:
            figure({**peer, "bench": bench_kind(row), "figure": row.get("figure")})
    except KeyError as exc:
        raise ReportError(f"{where}: bench {bench_kind(row)!r} needs field {exc.args[0]!r} for its figure"
                          + (" (in the row or its 'peer')" if peer is not None else "")) from None
    except (TypeError, ValueError) as exc:
        raise ReportError(f"{where}: bench {bench_kind(row)!r}: a field of its figure is not a number ({exc})") from None
    except _UnknownBench:
        raise ReportError(f"{where}: field 'bench': invalid value {bench_kind(row)!r}; accepted: "
                          f"{', '.join(sorted(_FIGURES))}") from None
    return row


# -- figures ----------------------------------------------------------------------------
class _UnknownBench(Exception):
    pass


def _n(value: float, digits: int = 1) -> str:
    """Thousands separated, with ``digits`` decimals."""
    return f"{value:,.{digits}f}"


def _rate(value: float) -> str:
    """A rate: one decimal below 1,000, none above (the last digit there is noise)."""
    return _n(value, 1 if value < 1000 else 0)


def _one_batch(row: dict[str, Any]) -> Figure:
    if row.get("figure") == "prefill":
        rate = row["prefill_throughput"]
        return Figure(f"{_n(row['prefill_latency_s'] * 1e3)} ms prefill ({_rate(rate)} tok/s)", rate)
    rate = row["median_decode_throughput"]
    return Figure(f"{row['median_decode_latency_s'] * 1e3:.3f} ms/step ({_rate(rate)} tok/s)", rate)


def _offline(row: dict[str, Any]) -> Figure:
    """Output tokens a second and the run's seconds; where the row carries the split (``engine
    bench offline`` since it reports one), the prefill and decode seconds and the decode steps."""
    rate = row["output_throughput"]
    split = ""
    if all(k in row for k in ("extend_time_s", "decode_time_s", "decode_steps")):
        split = (f": prefill {row['extend_time_s']:.1f} s, decode {row['decode_time_s']:.1f} s in "
                 f"{row['decode_steps']:,} steps")
    return Figure(f"{_rate(rate)} output tok/s ({row['duration_s']:.1f} s{split})", rate)


def _spec(row: dict[str, Any]) -> Figure:
    rate = row["decode_tokens_per_s"]
    text = f"{_rate(rate)} tok/s"
    if row.get("mean_accept_length"):
        text += f", acceptance {row['mean_accept_length']:.2f} of {row.get('num_draft_tokens', '?')}"
    return Figure(text, rate)


def _startup(row: dict[str, Any]) -> Figure:
    parts = [f"{label} {row[key]:.2f} s" for label, key in (("Engine", "generate_s"), ("serve", "serve_s"))
             if key in row]
    text = ", ".join(parts) + f" (import floor {row['floor_s']:.2f} s)"
    cpu = [f"{label} {row[key]:.2f}" for label, key in (("Engine", "generate_cpu_s"), ("serve", "serve_cpu_s"))
           if key in row]
    if cpu:
        text += "; CPU-s a run: " + ", ".join(cpu)
    return Figure(text, row.get("generate_s", row.get("serve_s")), higher_is_better=False)


def _serving(row: dict[str, Any]) -> Figure:
    if row.get("figure") == "throughput":
        return Figure(f"{_rate(row['output_throughput'])} output tok/s", row["output_throughput"])
    if row.get("figure") == "load":  # throughput under a load with the latencies it costs (a peer may have none)
        text = f"{_rate(row['output_throughput'])} output tok/s"
        if "median_ttft_ms" in row:
            text += (f"; TTFT p50 {_n(row['median_ttft_ms'], 0)} / p99 {_n(row['p99_ttft_ms'], 0)} ms; "
                     f"ITL p50 {row['median_itl_ms']:.1f} / p99 {_n(row['p99_itl_ms'])} ms")
        return Figure(text, row["output_throughput"])
    return Figure(f"mean TTFT {row['mean_ttft_ms']:.1f} ms", row["mean_ttft_ms"], higher_is_better=False)


def _multi_turn(row: dict[str, Any]) -> Figure:
    rate = row["request_throughput"]
    return Figure(f"{rate:.2f} turns/s ({_rate(row['input_throughput'])} prompt tok/s), median TTFT "
                  f"{_n(row['median_ttft_ms'], 0)} ms, {100 * row['cached_token_ratio']:.0f}% of prompt tokens cached",
                  rate)


def _disaggregation(row: dict[str, Any]) -> Figure:
    """KV transfer per request (a peer serving the prompts whole has none), then TTFT and ITL;
    ``figure: itl_p99`` (a run under load) adds throughput and compares ITL p99, else TTFT."""
    text = f"TTFT {_n(row['ttft_ms'])} ms, ITL {row['itl_ms']:.2f} ms"
    if "transfer_ms" in row:
        upload = row.get("decode_upload_ms")  # GPU pools: the host-to-device copy before the write
        uploaded = f"uploaded {_n(upload)} ms, " if upload is not None else ""
        copy = row.get("prefill_copy_ms")  # the host copy, off the prefill server's scheduler thread
        copied = f" (+ {_n(copy)} ms copy beside the next batch)" if copy is not None else ""
        text = (f"KV {_n(row['kv_mib'], 0)} MiB a request: staged {_n(row['prefill_stage_ms'])} ms{copied}, sent "
                f"{_n(row['transfer_ms'])} ms, {uploaded}written {_n(row['decode_write_ms'])} ms; " + text)
    if row.get("figure") == "itl_p99":
        text += f" (p99 {row['itl_p99_ms']:.2f} ms), {_rate(row['output_tok_s'])} output tok/s"
        return Figure(text, row["itl_p99_ms"], higher_is_better=False)
    return Figure(text, row["ttft_ms"], higher_is_better=False)


def _vision(row: dict[str, Any]) -> Figure:
    return Figure(f"encoder {_n(row['encoder_ms'])} ms of a {_n(row['image_prefill_ms'])} ms prefill "
                  f"(share {row['encoder_share']:.2f}); text-only prefill {_n(row['text_prefill_ms'])} ms",
                  row["image_prefill_ms"], higher_is_better=False)


def _hf(row: dict[str, Any]) -> Figure:
    key = row.get("figure") or "hf_eager_bs1_tok_s"
    return Figure(f"{_rate(row[key])} tok/s", row[key])


def _cpu_default(row: dict[str, Any]) -> Figure:
    return Figure(f"{row['engine_tok_s']:.1f} tok/s", row["engine_tok_s"])


def _cpu_compare(row: dict[str, Any]) -> Figure:
    """Engine, transformers and (batch 1, where it was importable) llama.cpp: rate and TTFT each."""
    parts = []
    for label, key in (("engine", "engine"), ("transformers", "transformers"), ("llama.cpp", "llama_cpp")):
        rate = row.get(f"{key}_tok_s")
        if rate is not None:
            parts.append(f"{label} {_rate(rate)} tok/s, TTFT {_n(row[f'{key}_ttft_ms'], 0)} ms")
    return Figure("; ".join(parts), row["engine_tok_s"])


def _scheduler(row: dict[str, Any]) -> Figure:
    return Figure(f"{row['median_step_ms']:.2f} ms/step", row["median_step_ms"], higher_is_better=False)


def _microseconds(row: dict[str, Any]) -> Figure:
    us = row["us"]
    return Figure(f"{_n(us, 2 if us < 100 else 1)} us", us, higher_is_better=False)


def _soak(row: dict[str, Any]) -> Figure:
    text = f"{row['requests']:,} requests, {row['lost']} lost, {row['errors']} errors"
    if "idle_p99_s" in row:
        text += (f"; p50 / p99 {row['idle_p50_s']:.2f} / {row['idle_p99_s']:.2f} s idle, "
                 f"{row['under_hostile_p50_s']:.2f} / {row['under_hostile_p99_s']:.2f} s under {row['hostile_requests']} "
                 "oversized prompts")
    return Figure(text)


_FIGURES: dict[str, Callable[[dict[str, Any]], Figure]] = {
    "one-batch": _one_batch, "offline": _offline, "spec": _spec, "startup": _startup, "serving": _serving,
    "hf-baseline": _hf, "default-model-cpu-decode": _cpu_default, "scheduler-decode-step": _scheduler,
    "all-reduce": _microseconds, "kernel": _microseconds, "soak": _soak, "cpu-compare": _cpu_compare,
    "vision": _vision, "multi-turn": _multi_turn, "disaggregation": _disaggregation,
}


def figure(row: dict[str, Any]) -> Figure:
    fn = _FIGURES.get(bench_kind(row))
    if fn is None:
        raise _UnknownBench
    return fn(row)


def ratio(row: dict[str, Any]) -> str:
    """The row's figure against its bound or its peer, or ``—`` where the row carries neither."""
    own = figure(row)
    bandwidth = copy_bandwidth(row)
    step_ms = _decode_step_ms(row, own)
    if "weight_gb" in row and bandwidth is not None and step_ms:
        bound_ms = row["weight_gb"] / bandwidth
        return (f"{bound_ms / step_ms:.2f} of the roofline ({bound_ms:.2f} ms: {row['weight_gb']:.2f} GB "
                f"at {bandwidth:.2f} TB/s)")
    peer = row.get("peer")
    if peer is not None:
        other = figure({**peer, "bench": bench_kind(row), "figure": row.get("figure")})
        return _times(own, other, peer["config"])
    kind = bench_kind(row)
    if kind == "default-model-cpu-decode":
        return _times(own, Figure("", row["transformers_tok_s"]), "transformers `generate`, same run")
    if kind == "cpu-compare":
        ratios = [_times(own, Figure("", row["transformers_tok_s"]), "transformers")]
        if row.get("llama_cpp_tok_s"):
            ratios.append(_times(own, Figure("", row["llama_cpp_tok_s"]), "llama.cpp"))
        return ", ".join(ratios) + f" (same run, load average {row['load_avg']:.1f})"
    if kind == "startup":
        parts = [f"{row[key] / row['floor_s']:.2f}x" for key in ("generate_s", "serve_s") if key in row]
        return " / ".join(parts) + " the import floor"
    if kind == "spec" and row.get("plain_decode_tokens_per_s"):
        return _times(own, Figure("", row["plain_decode_tokens_per_s"]), "its plain pass, same process")
    return "—"


def _decode_step_ms(row: dict[str, Any], own: Figure) -> float | None:
    """The decode step a roofline compares with: ``one-batch``'s median step, or a batch-1 rate's
    inverse (a ``hf-baseline`` row's ``..._bs1_...`` figure)."""
    kind = bench_kind(row)
    if kind == "one-batch" and row.get("figure") != "prefill":
        return row["median_decode_latency_s"] * 1e3
    if kind == "hf-baseline" and "_bs1_" in (row.get("figure") or "hf_eager_bs1_tok_s") and own.value:
        return 1e3 / own.value
    return None


def _times(own: Figure, other: Figure, what: str) -> str:
    if not own.value or not other.value:
        return "—"
    r = own.value / other.value if own.higher_is_better else other.value / own.value
    return f"{r:.2f}x {what}"


def copy_bandwidth(row: dict[str, Any]) -> float | None:
    name = device_name(row)
    for card, tb_s in COPY_BANDWIDTH_TB_S.items():
        if re.search(rf"\b{card}\b", name):
            return tb_s
    return None


def device_name(row: dict[str, Any]) -> str:
    """``2x H200`` from ``cuda:0 NVIDIA H200 (sm_90, ...)`` at TP=2; CPU rows as written."""
    raw = str(row.get("device") or row.get("machine"))
    match = _NVIDIA.search(raw)
    if not match:
        return "CPU" if raw == "cpu" else raw
    gpus = row.get("gpus") or math.prod(_size(row, k) for k in ("tp_size", "pp_size", "dp_size"))
    name = match.group(1).strip()
    return f"{gpus}x {name}" if gpus > 1 else name


# -- the page ---------------------------------------------------------------------------
HEADER = """\
# Benchmarks

The current figures, one table per area. Each row is the newest measurement of one configuration
on one device: what was measured, the command, the device, the date (UTC), the figure, and its
ratio to the bound or to the peer measured in the same run. The bound of a decode step is its
copy-bandwidth roofline: the weight bytes one step reads per GPU over the card's measured copy
bandwidth (H100 3.02 TB/s, H200 4.29 TB/s), so 1.00 is the most a step can reach. Against a peer,
`1.50x` means 1.5 times as fast as the peer (more tokens a second, or less time). Model shapes are
in `docs/bench_configs/`; rows with `--load-format dummy` use random weights of that shape.
`.cache/bench_grammar` (the Llama-3-8B shape with the default model's tokenizer) is made by
`bash scripts/device_wheels.sh`; `TINY` stands for a small random checkpoint made by
`engine.testing.checkpoints.make_tiny_checkpoint`.

**Reproduce** a row on a GPU machine: `bash scripts/install.sh` (where no package registry is
reachable, `bash scripts/device_wheels.sh` here fetches the wheels and `bash scripts/device_setup.sh`
installs them there), then the row's command, or `bash scripts/device_bench.sh STAGE...`, which runs
the commands by area (stages `one_batch_modes`, `offline`, `quant_one_batch`, `tp_quick`, `moe`,
`spec`, `grammar`, ...), appends their rows to `$OUT/results.jsonl` and writes their page to
`$OUT/benchmarks.md`. Kernel micro-benchmarks: [benchmarks/README.md](../benchmarks/README.md).

**This page is generated** from the result files in `docs/bench_results/`; do not edit it. To add a
measurement, append its row (what `--result-file` writes, with `area` and `config` where they
cannot be inferred; fields: `engine.bench.report`) to one of those files, then regenerate:

```
engine bench report docs/bench_results/*.jsonl --output docs/benchmarks.md
```

`--check` instead fails if the page differs from what the files give (a test runs it).
"""


def render(rows: Iterable[Row], sources: Sequence[str]) -> str:
    """The page: ``HEADER``, the source files, then every area's table of its newest rows."""
    newest: dict[tuple[str, str, str], Row] = {}
    for row in rows:
        old = newest.get(row.key)
        if old is None or row.fields["date"] >= old.fields["date"]:
            newest[row.key] = row
    out = [HEADER, "Result files: " + ", ".join(f"`{s}`" for s in sources) + ".\n"]
    for area in AREAS:
        chosen = sorted((r for r in newest.values() if r.area == area.key), key=lambda r: r.order)
        out.append(f"## {area.heading}\n")
        if not chosen:
            out.append(f"No current measurement; {area.produced_by} produces one.\n")
            continue
        out.append("| configuration | command | device | date | figure | ratio |\n|---|---|---|---|---|---|")
        for row in chosen:
            f = row.fields
            cells = [f["config"], f"`{f['command']}`", device_name(f), f["date"], figure(f).text, ratio(f)]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def build_page(paths: Sequence[str | Path]) -> str:
    """The page from ``paths``, read in name order (so a shell glob and a list give the same page)."""
    ordered = sorted((Path(p) for p in paths), key=lambda p: p.name)
    return render(read_rows(ordered), [p.name for p in ordered])
