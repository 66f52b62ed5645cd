"""Reading a checkpoint's config imports none of transformers' model-loading machinery
(``checkpoint._import_config_validators``), and the configs read are the ones transformers reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# In a fresh interpreter (a test process has transformers.activations in already): each config
# read as the engine reads it, whether transformers.activations got imported, then the activation
# names' validator, which must still refuse a bad name and import the table for it.
_READ = """
import json, sys
from engine.model_executor.checkpoint import load_hf_config
configs = {d: load_hf_config(d).to_dict() for d in sys.argv[1:]}
before = "transformers.activations" in sys.modules
from transformers.utils.type_validators import activation_fn_key
check = activation_fn_key("silu").metadata["validator"][0]
check("silu")
try:
    check("no-such-activation")
    refused = False
except ValueError:
    refused = True
print(json.dumps({"configs": configs, "activations_before": before, "refused": refused}, default=str))
"""


def test_configs_read_without_model_loading_imports(tmp_path: Path) -> None:
    from transformers import AutoConfig

    dirs = []
    for model_type in ("llama", "qwen2_vl", "deepseek_v3"):
        config = AutoConfig.for_model(model_type, architectures=["X"])
        config.save_pretrained(tmp_path / model_type)
        dirs.append(str(tmp_path / model_type))
    ran = subprocess.run([sys.executable, "-c", _READ, *dirs], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = json.loads(ran.stdout.strip().splitlines()[-1])
    assert got["activations_before"] is False
    assert got["refused"] is True
    import transformers.activations  # noqa: F401  # in already: this process reads them the plain way

    from engine.model_executor.checkpoint import load_hf_config

    for d in dirs:
        assert got["configs"][d] == json.loads(json.dumps(load_hf_config(d).to_dict(), default=str)), d
