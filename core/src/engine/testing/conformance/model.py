"""``ModelConformance``: a model plugin against Hugging Face transformers (logits and greedy tokens)."""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest

from engine import plugins
from engine.testing.conformance._common import KIT_SEED, derive_seed, device_or_skip


class ModelConformance:
    """Set ``architecture``; for an architecture name of your own, also ``reference_model``.

    The kit builds a tiny random checkpoint with the transformers class ``reference_model``
    (default: ``architecture``, which must then be a transformers class), writes
    ``architectures: [architecture]`` into its config.json, and runs it through the engine, which
    picks the model plugin registering ``architecture``; transformers' ``reference_model`` is the
    oracle. Logits at the last position of each prompt must agree within ``logits_atol``, and
    greedy generation must match token for token (float32).
    """

    #: the ``architectures`` name your plugin registers: it selects your model in the engine.
    architecture: ClassVar[str] = ""
    #: the transformers model class (or its name) your model reproduces; "" means ``architecture``.
    reference_model: ClassVar[str | type] = ""
    #: the transformers config class (or a registered ``model_type`` such as ``"llama"``);
    #: None: ``reference_model.config_class``.
    config_class: ClassVar[type | str | None] = None
    #: config values over the kit's tiny defaults.
    config_overrides: ClassVar[dict[str, Any]] = {}
    #: when set, the plugin (entry-point name) that must be the one serving ``architecture``.
    plugin_name: ClassVar[str] = ""
    logits_atol: ClassVar[float] = 1e-3
    max_new_tokens: ClassVar[int] = 24
    server_args: ClassVar[dict[str, Any]] = {}
    #: where and in what dtype both the engine and transformers run.
    device: ClassVar[str] = "cpu"
    dtype: ClassVar[str] = "float32"
    #: base of the seeds of the random weights and prompts.
    seed: ClassVar[int] = KIT_SEED

    @classmethod
    def _seed(cls, what: str) -> int:
        return derive_seed(cls.seed, cls.architecture, what)

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        from engine.testing.checkpoints import make_tiny_checkpoint

        path = tmp_path_factory.mktemp(cls.architecture or "model")
        return make_tiny_checkpoint(str(path), cls.architecture, seed=cls._seed("weights"),
                                    reference=cls.reference_model or None, config_class=cls.config_class,
                                    **cls.config_overrides)

    @pytest.fixture(scope="class")
    @classmethod
    def hf_model(cls, checkpoint: str) -> Any:
        from engine.testing.checkpoints import load_hf_model

        device_or_skip(cls.device)
        return load_hf_model(checkpoint, cls.dtype, cls.device, reference=cls.reference_model or cls.architecture)

    def _engine_args(self) -> dict[str, Any]:
        platform = "cpu" if self.device == "cpu" else self.device.split(":")[0]
        return {"platform": platform, "dtype": self.dtype, **self.server_args}

    @pytest.fixture(scope="class")
    @classmethod
    def prompts(cls) -> list[list[int]]:
        rng = random.Random(cls._seed("prompts"))
        return [[rng.randrange(4, 2048) for _ in range(n)] for n in (5, 17, 40, 3, 63)]

    def _where(self) -> str:
        return f"{self.architecture}, seeds {self._seed('weights')} (weights) / {self._seed('prompts')} (prompts)"

    def test_architecture_is_served_by_the_plugin(self) -> None:
        """The engine selects the plugin under test for ``architecture`` (not another plugin)."""
        registry = plugins.get_registry()
        owners = [e.plugin.name for e in registry.entries["model"].values() if self.architecture in e.spec.architectures]
        assert owners, (f"no installed model plugin registers architecture '{self.architecture}'; "
                        f"registered: {', '.join(plugins.model_architectures())}")
        assert len(owners) == 1, f"architecture '{self.architecture}' is registered by several plugins: {owners}"
        if self.plugin_name:
            assert owners == [self.plugin_name], (
                f"architecture '{self.architecture}' is served by plugin '{owners[0]}', not '{self.plugin_name}': "
                "give your model an architecture name of its own and set reference_model")

    def test_logits_match_transformers(self, checkpoint: str, hf_model: Any, prompts: list[list[int]]) -> None:
        from engine.testing.checkpoints import hf_last_logits
        from engine.testing.harness import last_position_logits, make_scheduler

        ours = last_position_logits(make_scheduler(checkpoint, **self._engine_args()), prompts)
        for i, p in enumerate(prompts):
            ref = hf_last_logits(hf_model, p)
            err = (ours[i] - ref).abs().max().item()
            assert err <= self.logits_atol, (
                f"prompt {i}: max abs logit error {err} > {self.logits_atol} ({self._where()})")

    def test_greedy_matches_transformers(self, checkpoint: str, hf_model: Any, prompts: list[list[int]]) -> None:
        from engine.testing.checkpoints import hf_greedy
        from engine.testing.harness import generate_greedy, make_scheduler

        sched = make_scheduler(checkpoint, **self._engine_args())
        ours = generate_greedy(sched, prompts, self.max_new_tokens)
        for i, p in enumerate(prompts):
            ref = hf_greedy(hf_model, p, self.max_new_tokens)
            if self.dtype == "float32":
                assert ours[i] == ref, f"prompt {i} differs: {ours[i]} vs transformers' {ref} ({self._where()})"
            else:
                check_greedy_until_near_tie(hf_model, p, ours[i], ref, self.max_new_tokens, self.tie_tolerance,
                                            f"prompt {i} ({self._where()})")

    #: bf16/fp16 only: where the two greedy paths first differ, transformers' logits of the two
    #: chosen tokens must be within this distance (a near-tie that rounding may break either way).
    tie_tolerance: ClassVar[float] = 0.1


def check_greedy_until_near_tie(hf_model: Any, prompt: list[int], ours: list[int], ref: list[int],
                                max_new_tokens: int, tie_tolerance: float, label: str,
                                oracle_model: Any = None) -> None:
    """Greedy outputs in bf16/fp16 must equal transformers' up to the first position where the two
    chosen tokens are a near-tie that rounding may break either way; a difference anywhere else fails.

    Args:
        hf_model: the transformers model that produced ``ref`` (in the same half precision).
        ours, ref: the engine's and transformers' greedy tokens (without the prompt).
        tie_tolerance: the largest logit gap between the two chosen tokens that counts as a tie.
        oracle_model: None: the gap is read from ``hf_model``'s own half-precision logits, which
            must rank our token at most ``tie_tolerance`` below theirs. A float32 transformers model
            of the same checkpoint: the gap is read from its logits instead, and either token may
            lead by up to ``tie_tolerance``: both half-precision runs are rounded, so judged in
            near-exact arithmetic either choice is legitimate within that distance, while half-
            precision logits would judge one rounded run by the other's rounding.

    Raises:
        ValueError: ``oracle_model`` is given but does not compute in float32.
    """
    from engine.testing.checkpoints import hf_last_logits

    if oracle_model is not None and str(getattr(oracle_model, "dtype", None)) != "torch.float32":
        raise ValueError(f"oracle_model computes in {getattr(oracle_model, 'dtype', None)}; accepted: a float32 "
                         "transformers model of the same checkpoint (or None to judge by hf_model's own logits)")

    k = next((j for j in range(min(len(ours), len(ref))) if ours[j] != ref[j]), None)
    if k is None:
        assert len(ours) == len(ref) or max_new_tokens in (len(ours), len(ref)), f"{label}: lengths differ"
        return
    where = f"{label}: token {k} differs ({ours[k]} vs transformers' {ref[k]})"
    if oracle_model is None:
        logits = hf_last_logits(hf_model, prompt + ref[:k])
        gap = (logits[ref[k]] - logits[ours[k]]).item()
        assert gap <= tie_tolerance, (
            f"{where} with a logit gap of {gap:.3f} > {tie_tolerance} (judged by the {_oracle_name(hf_model)} "
            "oracle: transformers' own logits in that precision; no float32 oracle given): not a rounding tie")
        return
    logits = hf_last_logits(oracle_model, prompt + ref[:k])
    gap = (logits[ref[k]] - logits[ours[k]]).item()
    top = int(logits.argmax().item())
    assert abs(gap) <= tie_tolerance, (
        f"{where} with a float32 logit gap of {gap:+.3f} (transformers' token minus ours), |gap| > "
        f"{tie_tolerance} (judged by the float32 oracle): not a rounding tie. float32 logits: argmax "
        f"{top} {logits[top].item():.3f}, transformers' {ref[k]} {logits[ref[k]].item():.3f}, "
        f"ours {ours[k]} {logits[ours[k]].item():.3f}")


def _oracle_name(model: Any) -> str:
    """Short name of the precision ``model`` computes in ("bf16", "fp16"), for messages."""
    dtype = str(getattr(model, "dtype", "")).removeprefix("torch.")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "float32"}.get(dtype, dtype or "half-precision")
