"""``engine bench spec``: decode speed of a batch, with the speculation the flags set.

Workloads (``--workload``):

- ``copy`` (default): a chat asks the model to repeat a long passage of its prompt word for word
  (the workload prompt-lookup speculation is for); needs the model's tokenizer.
- ``random``: ``--input-len`` random token ids per request (seeded, one prompt per row); needs no
  tokenizer, so it runs on a config-only directory with ``--load-format dummy
  --skip-tokenizer-init``.

The batch runs through the real scheduler in-process (admission, prefill, decode or speculative
decode steps), greedy, EOS ignored, to ``--output-len`` tokens, after a short warm-up on the same
prompts (kernels compiled, the prompts cached). Figures: output tokens per second of decode wall
time, the mean time of one decode step (``decode_s`` / steps: plain decode steps, or verify steps
with their drafting, plus the few plain steps of a speculative run where nothing was drafted), the
mean acceptance length (tokens per request and verify step) when speculation is on, and a hash of
the output ids so two runs can be compared.

``--ceiling`` measures what the mechanism allows with free, always-right drafts: the batch runs
plain, recording each row's output, then again with a proposer (``engine.testing.proposers.
OracleProposer``, registered in-process as the algorithm ``ceiling``) that proposes exactly the
recorded next tokens, ``k`` = ``--speculative-num-steps`` at a time. Both passes run in the same
scheduler, so their step times compare directly: verify step time / plain decode step time is
the verification overhead per step. In half precision a verify step's argmax may break a near-tie
differently from the plain step's (docs/speculative_internals.md, "Exactness and floating point"); the
rows then part from the recording and drafts start to fail, so the ceiling pass is repeated (up
to ``MAX_CEILING_ROUNDS`` times) with the previous pass's own output as the answers, until every
draft is accepted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import time
import types
from dataclasses import dataclass, field
from typing import Any

from engine.bench.results import append_rows
from engine.config import ServerArgs

WORKLOADS = ("copy", "random")
#: The in-process speculative algorithm of ``--ceiling``.
CEILING_ALGORITHM = "ceiling"
#: Ceiling passes at most (the first on the plain pass's output, the others on their predecessor's).
MAX_CEILING_ROUNDS = 4
#: Tokens per request of the warm-up run (at least one full verify step's worth, see ``_warmup_len``).
WARMUP_TOKENS = 8

#: Original prose (no dataset download): the passage the request quotes back.
PASSAGE = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every evening the "
    "keeper climbed the narrow stairs, cleaned the great lens, and lit the lamp before the sun went down. "
    "Ships that passed in the night saw the beam sweep across the water and knew where the rocks were hidden. "
    "When the storms came in winter, the waves rose higher than the houses in the village below, and the "
    "keeper stayed awake until morning, watching the light turn and listening to the wind. In spring the "
    "fishermen painted their boats in bright colours, mended their nets on the harbour wall, and told stories "
    "about the winters they had survived. Children ran along the beach looking for shells and pieces of "
    "green glass worn smooth by the sea. The keeper's daughter learned to read the weather from the shape of "
    "the clouds and the colour of the water, and she wrote everything down in a small notebook with a blue "
    "cover. Years later, when the light was finally replaced by an automatic lamp, she gave the notebook to "
    "the village school, where it is still kept in a glass case beside the window that looks out to sea."
)


@dataclass
class SpecWorkload:
    """What ``bench_spec`` runs besides the ``ServerArgs``."""

    batch_size: int = 1  # requests run at once
    output_len: int = 256  # tokens generated per request (greedy, EOS ignored)
    workload: str = "copy"  # one of WORKLOADS
    passages: int = 2  # copy: times the passage appears in the prompt
    input_len: int = 512  # random: prompt tokens per request
    seed: int = 1  # random: seed of the prompts
    ceiling: bool = False  # plain pass, then the oracle pass (see the module docstring)

    def check(self, args: ServerArgs) -> None:
        """Raises ``ValueError`` naming the flag, the value and what is accepted."""
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload: invalid value {self.workload!r}; accepted: {', '.join(WORKLOADS)}")
        for flag, value, least in (("--batch-size", self.batch_size, 1), ("--output-len", self.output_len, 2),
                                   ("--passages", self.passages, 1), ("--input-len", self.input_len, 1)):
            if value < least:
                raise ValueError(f"{flag}: invalid value {value}; accepted: an integer >= {least}")
        if self.workload == "copy" and args.skip_tokenizer_init:
            raise ValueError("--workload copy: needs the model's tokenizer, but --skip-tokenizer-init is set; "
                             "accepted: --workload random (random token ids, no tokenizer)")
        if self.ceiling and args.speculative_algorithm:
            raise ValueError(f"--ceiling: runs its own proposer (drafts = the plain pass's tokens); "
                             f"--speculative-algorithm {args.speculative_algorithm} cannot go with it: "
                             "leave it out and set k with --speculative-num-steps")
        if self.ceiling and self.batch_size > args.speculative_max_batch_size:
            raise ValueError(f"--batch-size: invalid value {self.batch_size} with --ceiling: above "
                             f"--speculative-max-batch-size {args.speculative_max_batch_size}, no step would "
                             "speculate; accepted: raise --speculative-max-batch-size to the batch size")


@dataclass
class Pass:
    """One timed run of the batch."""

    outputs: list[list[int]]
    wall_s: float  # the whole pass: admission, prefill and decode
    decode_s: float  # the scheduler's decode wall time (plain and speculative decode steps)
    steps: int  # decode steps run: plain ones plus verify ones
    spec: dict[str, int] = field(default_factory=dict)  # SpecStats counters of the pass (empty: no speculation)

    @property
    def decode_tokens(self) -> int:
        return sum(max(len(o) - 1, 0) for o in self.outputs)  # the first token comes from the prefill

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def step_ms(self) -> float:
        return 1000.0 * self.decode_s / self.steps if self.steps else 0.0

    @property
    def sha1(self) -> str:
        return hashlib.sha1(json.dumps(self.outputs).encode()).hexdigest()[:12]

    def figures(self, prefix: str = "", speculative: bool = True) -> dict[str, Any]:
        """The pass's figures, keys prefixed with ``prefix``; acceptance figures if ``speculative``."""
        out: dict[str, Any] = {"decode_tokens_per_s": self.tokens_per_s, "decode_s": self.decode_s,
                               "decode_steps": self.steps, "step_ms": self.step_ms, "total_s": self.wall_s,
                               "outputs_sha1": self.sha1}
        if self.spec and speculative:
            rows = self.spec["verified_rows"]
            out.update(mean_accept_length=self.spec["emitted_tokens"] / rows if rows else 0.0,
                       verify_steps=self.spec["verify_steps"], fallback_steps=self.spec["fallback_steps"],
                       proposed_tokens=self.spec["proposed_tokens"], accepted_tokens=self.spec["accepted_tokens"])
        return {prefix + k: v for k, v in out.items()}


def _copy_prompt_ids(model_path: str, passages: int) -> list[int]:
    from transformers import AutoTokenizer

    from engine.testing.default_model import chat_prompt_ids

    tok: Any = AutoTokenizer.from_pretrained(model_path)
    text = "\n\n".join([PASSAGE] * passages)
    chat = [{"role": "user", "content": f"Repeat the following text exactly, word for word, and add nothing:\n\n{text}"}]
    return chat_prompt_ids(tok, chat)


def random_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``batch_size`` prompts of ``input_len`` ids drawn uniformly below ``vocab_size``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(batch_size)]


def _run(scheduler: Any, prompts: list[list[int]], output_len: int, tag: str) -> Pass:
    """Runs ``prompts`` to ``output_len`` tokens each; request ids ``{tag}-{row}``."""
    from engine.testing.harness import OutputCollector, submit

    spec = scheduler.speculator
    before = (scheduler.decode_time_s, scheduler.decode_steps, dataclasses.asdict(spec.stats) if spec else {})
    started = time.perf_counter()
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    rids = [submit(scheduler, p, params, rid=f"{tag}-{i}") for i, p in enumerate(prompts)]
    col = OutputCollector()
    while scheduler.step():
        col.collect(scheduler)
    col.collect(scheduler)
    wall_s = time.perf_counter() - started
    stats = {k: v - before[2][k] for k, v in dataclasses.asdict(spec.stats).items()} if spec else {}
    return Pass([col.ids.get(r, []) for r in rids], wall_s, scheduler.decode_time_s - before[0],
                scheduler.decode_steps - before[1], stats)


def _warmup_len(args: ServerArgs) -> int:
    """Warm-up tokens per request: enough for one verify step with a full chain of drafts."""
    from engine.speculative.worker import num_draft_tokens_of

    return max(WARMUP_TOKENS, num_draft_tokens_of(args) + 2)


def _as_plugin(spec: Any) -> tuple[str, Any]:
    """An in-process plugin (for ``plugins.in_process_plugins``) that registers the
    ``SpeculativeAlgorithmSpec`` ``spec`` through the ordinary hook."""
    from engine.hookspecs import hookimpl

    module = types.ModuleType(f"engine_bench_{spec.name}")

    @hookimpl
    def register_speculative_algorithms(register: Any) -> None:
        register(spec)

    setattr(module, "register_speculative_algorithms", register_speculative_algorithms)  # noqa: B010 (a module built here)
    return spec.name, module


def _ceiling_scheduler(args: ServerArgs, model_path: str) -> tuple[Any, Any]:
    """A Scheduler whose proposer is an ``OracleProposer`` without answers (plain steps until
    it gets some); returns (scheduler, oracle)."""
    import engine.plugins as plugins
    from engine.hookspecs import SpeculativeAlgorithmSpec
    from engine.managers.scheduler import Scheduler
    from engine.testing.proposers import OracleProposer

    oracle = OracleProposer()
    spec = SpeculativeAlgorithmSpec(name=CEILING_ALGORITHM, factory=lambda ctx: oracle,
                                    description="engine bench spec --ceiling: drafts = the plain pass's tokens")
    ceiling_args = dataclasses.replace(args, speculative_algorithm=CEILING_ALGORITHM)
    with plugins.in_process_plugins(_as_plugin(spec)):
        ceiling_args.validate()  # the start-up checks of any algorithm (--speculative-num-steps, page size, ...)
        scheduler = Scheduler(ceiling_args, model_path)
    return scheduler, oracle


def _ceiling_passes(scheduler: Any, oracle: Any, prompts: list[list[int]], output_len: int,
                    warmup: int) -> tuple[Pass, Pass, int]:
    """(plain pass, last ceiling pass, ceiling passes run)."""
    oracle.forget()
    warm = _run(scheduler, prompts, warmup, "warm-plain")
    for i, out in enumerate(warm.outputs):
        oracle.expect(f"warm-ceiling-{i}", out)
    _run(scheduler, prompts, warmup, "warm-ceiling")  # verify steps compiled / replayed once
    oracle.forget()
    plain = _run(scheduler, prompts, output_len, "plain")
    answers = plain.outputs
    for rounds in range(1, MAX_CEILING_ROUNDS + 1):
        for i, out in enumerate(answers):
            oracle.expect(f"ceiling{rounds}-{i}", out)
        spec = _run(scheduler, prompts, output_len, f"ceiling{rounds}")
        if spec.spec["accepted_tokens"] == spec.spec["proposed_tokens"]:  # every draft right
            break
        answers = spec.outputs
    return plain, spec, rounds


def bench_spec(args: ServerArgs, work: SpecWorkload, result_file: str | None = None) -> dict[str, Any]:
    """Runs ``work`` with ``args``; prints one line (two with ``ceiling``) and returns the figures."""
    from engine.entrypoints.launch import resolve_model_path
    from engine.managers.scheduler import Scheduler

    work.check(args)
    model_path = resolve_model_path(args)
    if work.ceiling:
        scheduler, oracle = _ceiling_scheduler(args, model_path)
    else:
        scheduler, oracle = Scheduler(args, model_path), None
    if work.workload == "copy":
        prompts = [_copy_prompt_ids(args.tokenizer_path or model_path, work.passages)] * work.batch_size
    else:
        prompts = random_prompts(work.batch_size, work.input_len, scheduler.runner.vocab_size, work.seed)
    spec = scheduler.speculator
    k = spec.num_draft_tokens - 1 if spec is not None else 0
    result: dict[str, Any] = {
        "bench": "spec", "device": scheduler.runner.platform.describe(), "model_path": args.model_path,
        "attention": scheduler.runner.attention_backend_name,
        "algorithm": CEILING_ALGORITHM if work.ceiling else args.speculative_algorithm,
        "num_draft_tokens": spec.num_draft_tokens if spec is not None else 1, "workload": work.workload,
        "batch_size": work.batch_size, "prompt_tokens": len(prompts[0]), "output_len": work.output_len,
        "cuda_graph": scheduler.runner.cuda_graph_runner is not None,
        "verify_graphs": spec is not None and spec.verify_graphs is not None,
    }
    head = f"batch {work.batch_size}, prompt {len(prompts[0])} tokens"
    if oracle is not None:
        plain, run, rounds = _ceiling_passes(scheduler, oracle, prompts, work.output_len, _warmup_len(args))
        result.update(plain.figures("plain_", speculative=False))
        result.update(run.figures(), ceiling_rounds=rounds, outputs_equal_plain=run.outputs == plain.outputs,
                      speedup=run.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0,
                      verify_overhead=run.step_ms / plain.step_ms if plain.step_ms else 0.0)
        print(f"spec plain (ceiling run): {head}, {_speed(plain)}, {plain.step_ms:.2f} ms/decode step, "
              f"outputs {plain.sha1}", flush=True)
        same = "= plain" if result["outputs_equal_plain"] else "differ from plain (half-precision near-ties)"
        print(f"spec ceiling k={k}: {head}, {_speed(run)} ({result['speedup']:.2f}x plain), mean acceptance "
              f"length {result['mean_accept_length']:.2f} of {k + 1}, {run.step_ms:.2f} ms/verify step = "
              f"{result['verify_overhead']:.2f}x a decode step, outputs {run.sha1} {same}, {rounds} round(s)",
              flush=True)
    else:
        distinct = [list(p) for p in dict.fromkeys(tuple(p) for p in prompts)]
        _run(scheduler, distinct, _warmup_len(args), "warm")  # kernels compiled, the prompts cached
        run = _run(scheduler, prompts, work.output_len, "run")
        result.update(run.figures())
        label = f"{args.speculative_algorithm} k={k}" if spec is not None else "off"
        what = "verify step" if spec is not None else "decode step"
        print(f"spec {label}: {head}, {_speed(run)}"
              + (f", mean acceptance length {result['mean_accept_length']:.2f} of {k + 1}" if spec is not None else "")
              + f", {run.step_ms:.2f} ms/{what}, outputs {run.sha1}", flush=True)
    append_rows(result_file, result)
    return result


def _speed(run: Pass) -> str:
    return f"{run.decode_tokens} decode tokens in {run.decode_s:.3f} s = {run.tokens_per_s:.1f} tok/s"
