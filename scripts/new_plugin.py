"""Creates a new plugin distribution from plugins/_template.

usage: python scripts/new_plugin.py KIND NAME [--dest DIR]
KIND: attention | quant | model | policy | platform | router | toolparser | reasoning | grammar | spec | lora | kvtier
      | kvtransfer
NAME: the name users see and select (``--reasoning-parser NAME``, ``engine plugins list``,
``--disable-plugin NAME``): letters, digits, ``_`` and ``-`` (``deep-think``). It is the
entry-point name and the registered name; the import package spells ``-`` as ``_``
(``engine_reasoning_deep_think``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

TEMPLATE = pathlib.Path(__file__).resolve().parent.parent / "plugins" / "_template"
# Every distribution of ours and of the template's plugins starts with this prefix (free on PyPI;
# `engine-core` belongs to an unrelated project, so depending on it would pull that in).
DISTRIBUTION_PREFIX = "plugserve"
# The kind's segment in distribution and package names, as the built-in plugins spell it
# (plugserve-models-llama / engine_models_llama).
NAME_SEGMENT = {"model": "models"}
# A user-facing name: words of letters and digits joined by single '_' or '-', starting with a letter.
NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_][A-Za-z0-9]+)*")

KINDS = {
    "attention": dict(
        deps=["plugserve-attention-torch-native>=0.1"],
        hook="register_attention_backends", spec_cls="AttentionBackendSpec", kit="AttentionBackendConformance",
        spec='AttentionBackendSpec(name="{name}", factory="{package}.impl:create", device_types=("cpu", "cuda"))',
        kit_attrs='    backend_name = "{name}"',
        impl=('from engine.attention import AttentionContext\n'
              'from engine_attention_torch_native.backend import TorchNativeAttnBackend\n\n\n'
              'class Backend(TorchNativeAttnBackend):\n    """Starts as the reference backend; replace forward_extend/forward_decode."""\n\n\n'
              'def create(ctx: AttentionContext) -> Backend:\n    return Backend(ctx)\n')),
    "policy": dict(
        deps=[],
        hook="register_schedule_policies", spec_cls="SchedulePolicySpec", kit="SchedulePolicyConformance",
        spec='SchedulePolicySpec(name="{name}", factory="{package}.impl:Policy")',
        kit_attrs='    policy_name = "{name}"',
        impl=('from engine.managers.policy import PolicyContext, SchedulePolicy\n\n\n'
              'class Policy(SchedulePolicy):\n    def order(self, queue, ctx: PolicyContext):  # type: ignore[no-untyped-def]\n'
              '        return sorted(queue, key=lambda r: r.arrival_seq)\n')),
    "router": dict(
        deps=[],
        hook="register_router_policies", spec_cls="RouterPolicySpec", kit="RouterPolicyConformance",
        spec='RouterPolicySpec(name="{name}", factory="{package}.impl:Policy")',
        kit_attrs='    policy_name = "{name}"',
        impl=('from collections.abc import Sequence\n\n'
              'from engine.router import ReplicaLoad, RouteDecision, RouteRequest, RouterPolicy\n\n\n'
              'class Policy(RouterPolicy):\n    """Starts as shortest-queue: the replica with the fewest requests in flight."""\n\n'
              '    def route(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> RouteDecision:\n'
              '        best = min(loads, key=lambda r: (r.in_flight_requests, r.routed_requests, r.index))\n'
              '        return RouteDecision(best.index, "least_loaded")\n')),
    "toolparser": dict(
        deps=["plugserve-toolparser-hermes>=0.1"],
        hook="register_tool_call_parsers", spec_cls="ToolCallParserSpec", kit="ToolCallParserConformance",
        kit_imports="ToolCallCase, ToolCallParserConformance",
        spec='ToolCallParserSpec(name="{name}", factory="{package}.impl:Parser")',
        kit_attrs=('    parser_name = "{name}"\n'
                   '    # Recorded outputs of your model and what they must parse to (replace with your format\'s).\n'
                   '    cases = (ToolCallCase(\'<tool_call>{{"name": "f", "arguments": {{"a": 1}}}}</tool_call>\', '
                   'calls=(("f", {{"a": 1}}),)),)'),
        impl=('from engine_toolparser_hermes.parser import HermesToolCallParser\n\n\n'
              'class Parser(HermesToolCallParser):\n'
              '    """Starts as the hermes format; override parse_partial and render_calls for yours."""\n')),
    "reasoning": dict(
        deps=[],
        hook="register_reasoning_parsers", spec_cls="ReasoningParserSpec", kit="ReasoningParserConformance",
        kit_imports="ReasoningCase, ReasoningParserConformance",
        spec='ReasoningParserSpec(name="{name}", factory="{package}.impl:Parser")',
        kit_attrs=('    parser_name = "{name}"\n'
                   '    cases = (ReasoningCase("<think>hmm</think>Answer", "hmm", "Answer"),)'),
        impl=('from engine.parsers import ThinkTagReasoningParser\n\n\n'
              'class Parser(ThinkTagReasoningParser):\n'
              '    """Starts as <think>...</think> written by the model; set start, end, starts_in_reasoning."""\n\n'
              '    starts_in_reasoning = False\n')),
    "grammar": dict(
        deps=["plugserve-grammar-xgrammar>=0.1"],
        hook="register_grammar_backends", spec_cls="GrammarBackendSpec", kit="GrammarBackendConformance",
        spec=('GrammarBackendSpec(name="{name}", factory="{package}.impl:Backend", '
              'grammar_kinds=("json_schema", "regex", "ebnf", "structural_tag"), supports_rollback=True)'),
        kit_attrs=('    backend_name = "{name}"\n'
                   '    json_separators = (", ", ": ")  # how your JSON separates items and keys (xgrammar\'s here)'),
        impl=('from engine_grammar_xgrammar.backend import XGrammarBackend\n\n\n'
              'class Backend(XGrammarBackend):\n'
              '    """Starts as the xgrammar backend; replace validate, compile and matcher with your library\'s\n'
              '    (engine.constrained.GrammarBackend / GrammarMatcher, docs/structured_output.md)."""\n')),
    "spec": dict(
        deps=["plugserve-spec-ngram>=0.1"],
        hook="register_speculative_algorithms", spec_cls="SpeculativeAlgorithmSpec",
        kit="SpeculativeProposerConformance",
        spec='SpeculativeAlgorithmSpec(name="{name}", factory="{package}.impl:create")',
        kit_attrs='    algorithm_name = "{name}"',
        impl=('from engine.speculative import ProposerContext\n'
              'from engine_spec_ngram.proposer import NgramProposer\n\n\n'
              'class MyProposer(NgramProposer):\n'
              '    """Starts as prompt lookup; replace propose (and on_verified, release(rid, reason) and\n'
              '    on_request_end if you keep state across steps or requests)\n'
              '    (engine.speculative.Proposer, docs/speculative_internals.md)."""\n\n\n'
              'def create(ctx: ProposerContext) -> MyProposer:\n    return MyProposer()\n')),
    "lora": dict(
        deps=["plugserve-lora-torch-native>=0.1"],
        hook="register_lora_backends", spec_cls="LoraBackendSpec", kit="LoraBackendConformance",
        spec='LoraBackendSpec(name="{name}", factory="{package}.impl:Backend", device_types=("cpu", "cuda"))',
        kit_attrs='    backend_name = "{name}"',
        impl=('from engine_lora_torch_native.backend import TorchNativeLoraBackend\n\n\n'
              'class Backend(TorchNativeLoraBackend):\n'
              '    """Starts as the torch reference; replace shrink and expand (engine.lora.backend.LoraBackend,\n'
              '    docs/lora.md)."""\n\n'
              '    name = "{name}"\n')),
    "kvtier": dict(
        deps=[],
        hook="register_kv_storage_tiers", spec_cls="KvStorageTierSpec", kit="KvStorageTierConformance",
        spec='KvStorageTierSpec(name="{name}", factory="{package}.impl:Tier", device_types=("cpu", "cuda"))',
        kit_attrs='    tier_name = "{name}"',
        impl=('from engine.mem_cache.kv_tier import HostMemoryTier\n\n\n'
              'class Tier(HostMemoryTier):\n'
              '    """Starts as the host-memory tier; replace write and read (and close) with your store\'s\n'
              '    (engine.mem_cache.kv_tier.KvStorageTier, docs/kv_cache.md)."""\n')),
    "kvtransfer": dict(
        deps=["plugserve-kvtransfer-zmq>=0.1"],
        hook="register_kv_transfer_backends", spec_cls="KvTransferSpec", kit="KvTransferConformance",
        spec='KvTransferSpec(name="{name}", factory="{package}.impl:Backend", device_types=("cpu", "cuda"))',
        kit_attrs='    backend_name = "{name}"',
        impl=('from engine_kvtransfer_zmq.backend import ZmqKvTransfer\n\n\n'
              'class Backend(ZmqKvTransfer):\n'
              '    """Starts as the ZeroMQ/TCP transfer; replace publish/discard (prefill side) and\n'
              '    fetch/cancel/poll (decode side) with your transport\n'
              '    (engine.disaggregation.KvTransferBackend, docs/disaggregation.md)."""\n')),
    "platform": dict(
        deps=["plugserve-platform-cpu>=0.1"],
        hook="register_platforms", spec_cls="PlatformSpec", kit="PlatformConformance",
        spec='PlatformSpec(name="{name}", factory="{package}.impl:MyPlatform", device_type="cpu")',
        kit_attrs='    platform_name = "{name}"',
        impl=('from engine_platform_cpu.platform import CpuPlatform\n\n\n'
              'class MyPlatform(CpuPlatform):\n    name = "{name}"\n\n    def is_available(self) -> bool:\n'
              '        return False  # claim the machine only when your device is present\n\n'
              '    def unavailable_reason(self) -> str:\n        return "not implemented yet"\n')),
    "quant": dict(
        deps=[],
        hook="register_quantization_methods", spec_cls="QuantMethodSpec", kit="QuantMethodConformance",
        spec='QuantMethodSpec(name="{name}", factory="{package}.impl:Config.from_config", device_types=("cpu", "cuda"))',
        kit_attrs='    method_name = "{name}"\n    max_rel_error = 1e-6',
        impl=('from engine.layers import QuantizationConfig, UnquantizedLinearMethod\n\n\n'
              'class Config(QuantizationConfig):\n    name = "{name}"\n\n    @classmethod\n'
              '    def from_config(cls, config):  # type: ignore[no-untyped-def]\n        return cls()\n\n'
              '    def get_linear_method(self, layer, prefix):  # type: ignore[no-untyped-def]\n'
              '        return UnquantizedLinearMethod()  # replace with your LinearMethodBase\n')),
    "model": dict(
        deps=["plugserve-models-llama>=0.1"],
        hook="register_models", spec_cls="ModelSpec", kit="ModelConformance",
        # The architecture name is the plugin's own, so the engine selects this plugin (not the
        # built-in llama one) for a checkpoint whose config.json names it.
        spec='ModelSpec(name="{name}", architectures=("{arch}",), factory="{package}.impl:{arch}")',
        kit_attrs=('    architecture = "{arch}"  # what your plugin registers; the kit writes it into config.json\n'
                   '    reference_model = "LlamaForCausalLM"  # the transformers class your model must reproduce\n'
                   '    plugin_name = "{name}"  # fail if another plugin serves the architecture'),
        impl=('from engine_models_llama.llama import LlamaForCausalLM\n\n\n'
              'class {arch}(LlamaForCausalLM):\n    """Starts as the Llama implementation; change what differs."""\n')),
}


def render(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("name")
    ap.add_argument("--dest", default=None)
    args = ap.parse_args(argv)
    if not NAME_PATTERN.fullmatch(args.name):
        print(f"error: NAME: invalid value {args.name!r}; accepted: letters and digits in words joined by '_' or "
              "'-', starting with a letter (my_backend, deep-think)", file=sys.stderr)
        return 2
    kind = KINDS[args.kind]
    segment = NAME_SEGMENT.get(args.kind, args.kind)
    # One name everywhere users meet it (entry point and registered name); Python spells it with '_'.
    ident = args.name.replace("-", "_")
    package = f"engine_{segment}_{ident}"
    distribution = f"{DISTRIBUTION_PREFIX}-{segment}-{ident.replace('_', '-')}"
    values = {"kind": args.kind, "name": args.name, "package": package, "distribution": distribution,
              "class_name": "".join(p[:1].upper() + p[1:] for p in ident.split("_")), "hook": kind["hook"],
              "kit": kind["kit"], "kit_imports": kind.get("kit_imports", kind["kit"]), "register_import": f"from engine.hookspecs import {kind['spec_cls']}"}
    # The starting implementation subclasses a built-in plugin: declare it as a dependency.
    values["extra_deps"] = "".join(f', "{d}"' for d in kind["deps"])
    arch = f"{values['class_name']}ForCausalLM"  # a model plugin's own architecture name
    for key in ("spec", "kit_attrs", "impl"):
        values[key] = kind[key].format(name=args.name, package=package, arch=arch)
    dest = pathlib.Path(args.dest or distribution)
    if dest.exists() and any(dest.iterdir()):
        print(f"error: --dest {dest} exists and is not empty", file=sys.stderr)
        return 2
    for src in TEMPLATE.rglob("*.tmpl"):
        rel = str(src.relative_to(TEMPLATE))[: -len(".tmpl")]
        rel = rel.replace("engine_KIND_NAME", package).replace("KIND_NAME", f"{segment}_{ident}")
        out = dest / rel
        os.makedirs(out.parent, exist_ok=True)
        out.write_text(render(src.read_text(encoding="utf-8"), values), encoding="utf-8")
    print(f"created {distribution} in {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
