"""LoRA adapters served on one base model (docs/lora.md).

- ``engine.lora.backend``: the interface of LoRA backend plugins (``LoraBatchInfo``,
  ``LoraBackend``) and the plain torch reference they are checked against.
- ``engine.lora.adapter``: reading and validating PEFT adapter directories.
- ``engine.lora.layers``: the LoRA-wrapped linear layers a model's projections become.
- ``engine.lora.manager``: host copies of the loaded adapters, the device slot pool and the
  per-forward batch info; ``engine.lora.setup`` builds it for a model runner.
"""
