"""Registration of the Granite model."""

from __future__ import annotations

from engine.hookspecs import ModelSpec, hookimpl


@hookimpl
def register_models(register):  # type: ignore[no-untyped-def]
    register(ModelSpec(
        name="granite",
        architectures=("GraniteForCausalLM",),
        factory="engine_models_granite.granite:GraniteForCausalLM",
        description="IBM Granite 3.x dense models",
    ))
