"""Reading a checkpoint's config imports none of transformers' model-loading machinery
(``checkpoint._import_config_validators``) and reads transformers' model sources once
(``checkpoint._import_models_package``), and the configs read are the ones transformers reads."""

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
# transformers.models got the table derived from transformers' own (_import_models_package): it
# must be the one the package builds by reading the model sources.
from transformers.utils import import_utils
models = sys.modules["transformers.models"]
own = import_utils._LazyModule(models.__name__, models.__file__,
                               import_utils.define_import_structure.__wrapped__(models.__file__))
same = all(getattr(models, a) == getattr(own, a) for a in
           ("_modules", "_class_to_module", "_object_missing_backend", "_explicit_import_shortcut"))
# Its lists of names come from sets: their order is no part of the table.
same = same and ({k: sorted(v) for k, v in models._import_structure.items()}
                 == {k: sorted(v) for k, v in own._import_structure.items()})
print(json.dumps({"configs": configs, "activations_before": before, "refused": refused,
                  "models_table_same": same and sorted(models.__all__) == sorted(own.__all__)}, default=str))
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
    assert got["models_table_same"] is True
    import transformers.activations  # noqa: F401  # in already: this process reads them the plain way

    from engine.model_executor.checkpoint import load_hf_config

    for d in dirs:
        assert got["configs"][d] == json.loads(json.dumps(load_hf_config(d).to_dict(), default=str)), d
