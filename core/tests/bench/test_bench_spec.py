"""``engine bench spec`` on the CPU: the random workload on config-only directories with dummy
weights (no tokenizer), the ``--ceiling`` passes (every draft accepted, output equal to the plain
pass), a 2-layer dummy draft model, and the flags' errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from engine import plugins
from engine.bench import spec as spec_bench
from engine.bench.spec import SpecWorkload, bench_spec, random_prompts
from engine.cli import app
from engine.config import ServerArgs

#: A small Llama shape (float32: speculation equals plain decoding exactly).
_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 512,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
    "bos_token_id": 0, "eos_token_id": 3, "tie_word_embeddings": False, "hidden_act": "silu",
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Config-only directories (no weights, no tokenizer): a 4-layer target and a 2-layer draft."""
    root = tmp_path_factory.mktemp("spec-bench")
    dirs = []
    for name, layers in (("target", 4), ("draft", 2)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({**_CONFIG, "num_hidden_layers": layers}))
        dirs.append(str(root / name))
    return dirs[0], dirs[1]


def _args(target: str, **kw: Any) -> ServerArgs:
    return ServerArgs.from_dict({"model_path": target, "load_format": "dummy", "skip_tokenizer_init": True,
                                 "platform": "cpu", "max_total_tokens": 4096, **kw})


def _random(**kw: Any) -> SpecWorkload:
    return SpecWorkload(**{"workload": "random", "batch_size": 2, "input_len": 24, "output_len": 16, **kw})


def test_random_workload_runs_on_dummy_weights_and_prints_its_figures(
        configs: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "res.jsonl"
    result = bench_spec(_args(configs[0]), _random(batch_size=3), str(out_file))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("spec off: batch 3, prompt 24 tokens, 45 decode tokens in ")
    assert " ms/decode step, outputs " + result["outputs_sha1"] in line
    # Three rows decode together: 15 steps after the prefill's token; the step time is decode_s / steps.
    assert result["decode_steps"] == 15
    assert result["step_ms"] == pytest.approx(1000 * result["decode_s"] / 15)
    assert result["workload"] == "random" and result["algorithm"] is None and "mean_accept_length" not in result
    written = json.loads(out_file.read_text())
    assert (written.pop("command"), written.pop("date")) and written == result  # append_rows stamps both
    again = bench_spec(_args(configs[0]), _random(batch_size=3))
    assert again["outputs_sha1"] == result["outputs_sha1"]  # seeded prompts, greedy
    assert bench_spec(_args(configs[0]), _random(batch_size=3, seed=2))["outputs_sha1"] != result["outputs_sha1"]


def test_random_prompts_are_seeded_and_in_the_vocabulary() -> None:
    a = random_prompts(3, 50, 100, seed=4)
    assert a == random_prompts(3, 50, 100, seed=4) != random_prompts(3, 50, 100, seed=5)
    assert [len(p) for p in a] == [50] * 3 and all(0 <= t < 100 for p in a for t in p)
    assert len({tuple(p) for p in a}) == 3


@pytest.mark.parametrize("k, output_len, steps", [
    (4, 21, 4),  # 20 decode tokens: 4 verify steps of k + 1 = 5
    (2, 16, 5),  # 15 tokens: 5 steps of 3
    (4, 23, 5),  # 22 tokens: 5, 5, 5, 5, then 2 (the request ends: 1 draft left to propose)
])
def test_ceiling_accepts_every_draft_and_equals_the_plain_pass(
        configs: tuple[str, str], capsys: pytest.CaptureFixture[str], k: int, output_len: int, steps: int) -> None:
    registry_facade = plugins.get_registry
    result = bench_spec(_args(configs[0], speculative_num_steps=k), _random(output_len=output_len, ceiling=True))
    lines = capsys.readouterr().out.strip().splitlines()
    decode_tokens = output_len - 1
    assert result["algorithm"] == "ceiling" and result["num_draft_tokens"] == k + 1
    assert result["outputs_sha1"] == result["plain_outputs_sha1"] and result["outputs_equal_plain"]
    assert result["accepted_tokens"] == result["proposed_tokens"] == 2 * (decode_tokens - steps)
    assert result["verify_steps"] == steps and result["fallback_steps"] == 0 and result["ceiling_rounds"] == 1
    assert result["mean_accept_length"] == pytest.approx(decode_tokens / steps)
    if decode_tokens % (k + 1) == 0:
        assert result["mean_accept_length"] == k + 1
    # The plain pass: one decode step per token, no acceptance figures.
    assert result["plain_decode_steps"] == decode_tokens and "plain_mean_accept_length" not in result
    assert result["verify_overhead"] == pytest.approx(result["step_ms"] / result["plain_step_ms"])
    assert lines[-2].startswith("spec plain (ceiling run): batch 2, prompt 24 tokens, ")
    assert lines[-1].startswith(f"spec ceiling k={k}: ") and "= plain, 1 round(s)" in lines[-1]
    assert f"of {k + 1}, " in lines[-1] and "ms/verify step = " in lines[-1]
    # The in-process algorithm was there for the scheduler's start only.
    assert plugins.get_registry is registry_facade
    assert "ceiling" not in plugins.speculative_algorithms()


def test_ceiling_repeats_on_its_own_output_when_rows_part_from_the_recording(
        configs: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """What a half-precision near-tie does (rows part from the plain pass), forced here by a
    wrong recorded token: the first ceiling pass rejects drafts (its output is still exact),
    the second, on the first's own output, accepts every draft."""
    made: list[Any] = []
    build = spec_bench._ceiling_scheduler

    def spoiling_scheduler(args: ServerArgs, model_path: str) -> tuple[Any, Any]:
        scheduler, oracle = build(args, model_path)
        expect = oracle.expect

        def spoiled(rid: str, output: list[int]) -> None:
            expect(rid, [*output[:6], (output[6] + 1) % 512, *output[7:]] if rid == "ceiling1-0" else output)

        monkeypatch.setattr(oracle, "expect", spoiled)
        made.append(scheduler)
        return scheduler, oracle

    monkeypatch.setattr(spec_bench, "_ceiling_scheduler", spoiling_scheduler)
    result = bench_spec(_args(configs[0], speculative_num_steps=4), _random(output_len=21, ceiling=True))
    assert made and result["ceiling_rounds"] == 2
    assert result["outputs_equal_plain"] and result["mean_accept_length"] == 5.0
    assert result["accepted_tokens"] == result["proposed_tokens"]


def test_two_layer_dummy_draft_runs(configs: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = configs
    plain = bench_spec(_args(target), _random())
    result = bench_spec(_args(target, speculative_algorithm="draft", speculative_draft_model_path=draft,
                              speculative_num_steps=3), _random())
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("spec draft k=3: batch 2, prompt 24 tokens, 30 decode tokens in ")
    assert result["outputs_sha1"] == plain["outputs_sha1"]  # float32: exact whatever the draft proposes
    assert result["verify_steps"] > 0 and result["proposed_tokens"] > 0
    assert result["decode_steps"] == result["verify_steps"] + result["fallback_steps"]
    assert 1.0 <= result["mean_accept_length"] <= 4.0


def _cli(*flags: str) -> Any:
    return CliRunner().invoke(app, ["bench", "spec", "--load-format", "dummy", "--skip-tokenizer-init",
                                    "--platform", "cpu", "--max-total-tokens", "4096", *flags])


def test_cli_random_ceiling(configs: tuple[str, str], tmp_path: Path) -> None:
    res = tmp_path / "r.jsonl"
    out = _cli("--model-path", configs[0], "--workload", "random", "--input-len", "20", "--output-len", "9",
               "--ceiling", "--speculative-num-steps", "3", "--result-file", str(res))
    assert out.exit_code == 0, out.output
    assert "spec ceiling k=3: batch 1, prompt 20 tokens, 8 decode tokens" in out.output
    assert "mean acceptance length 4.00 of 4" in out.output
    row = json.loads(res.read_text())
    assert row["algorithm"] == "ceiling" and row["prompt_tokens"] == 20 and row["ceiling_rounds"] == 1


@pytest.mark.parametrize("flags, message", [
    (["--workload", "copy"], "--workload copy: needs the model's tokenizer, but --skip-tokenizer-init is set"),
    (["--workload", "file"], "--workload: invalid value 'file'; accepted: copy, random"),
    (["--input-len", "64"], "--input-len: applies to --workload random only"),
    (["--workload", "random", "--input-len", "0"], "--input-len: invalid value 0; accepted: an integer >= 1"),
    (["--workload", "random", "--output-len", "1"], "--output-len: invalid value 1; accepted: an integer >= 2"),
    (["--workload", "random", "--ceiling", "--speculative-algorithm", "ngram"],
     "--ceiling: runs its own proposer .* --speculative-algorithm ngram cannot go with it"),
    (["--workload", "random", "--ceiling", "--batch-size", "3", "--speculative-max-batch-size", "2"],
     "--batch-size: invalid value 3 with --ceiling: above --speculative-max-batch-size 2"),
    (["--workload", "random", "--ceiling", "--speculative-num-steps", "0"],
     "--speculative-num-steps: invalid value 0; accepted: an integer >= 1"),
])
def test_cli_errors_name_the_flag(configs: tuple[str, str], flags: list[str], message: str) -> None:
    import re

    out = _cli("--model-path", configs[0], *flags)
    assert out.exit_code != 0
    assert re.search(message, " ".join(out.output.split())), out.output
