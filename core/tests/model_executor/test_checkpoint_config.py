"""Reading a checkpoint's config imports none of transformers' model-loading machinery
(``checkpoint._import_config_validators``), takes transformers' table of model modules from the
engine's cache or builds it once (``checkpoint._import_transformers`` and
``_import_models_package``), and the configs read are the ones transformers reads."""

from __future__ import annotations

import json
import os
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
# The tables transformers and transformers.models got (from the cache file, or derived from the
# first) must be the ones they build by reading the model sources. Their lists of names come from
# sets: their order is no part of a table.
from pathlib import Path
from transformers.utils import import_utils
build = import_utils.define_import_structure.__wrapped__


def same(got, own):
    return all(getattr(got, attr) == getattr(own, attr)
               for attr in ("_modules", "_class_to_module", "_object_missing_backend", "_explicit_import_shortcut"))


def same_models_part(got, own):
    # got (transformers' own table) holds own (the models' part) and only top-level modules beside.
    for attr in ("_class_to_module", "_object_missing_backend", "_explicit_import_shortcut"):
        table = getattr(got, attr)
        if any(table.get(k, k) != v for k, v in getattr(own, attr).items()):
            return False
    beside = got._modules - own._modules
    return (own._modules <= got._modules and not any(m.startswith("models.") for m in beside)
            and not any(m.startswith("models.") for k, m in got._class_to_module.items() if k not in own._class_to_module))


top, models = sys.modules["transformers"], sys.modules["transformers.models"]
own_top = import_utils._LazyModule("t", top.__file__, build(Path(top.__file__).parent / "models", prefix="models"))
own_models = import_utils._LazyModule(models.__name__, models.__file__, build(models.__file__))
tables_same = (same_models_part(top, own_top) and same(models, own_models)
               and {k: sorted(v) for k, v in models._import_structure.items()}
               == {k: sorted(v) for k, v in own_models._import_structure.items()})
print(json.dumps({"configs": configs, "activations_before": before, "refused": refused,
                  "tables_same": tables_same}, default=str))
"""


def test_configs_read_without_model_loading_imports(tmp_path: Path) -> None:
    from transformers import AutoConfig

    dirs = []
    for model_type in ("llama", "qwen2_vl", "deepseek_v3"):
        config = AutoConfig.for_model(model_type, architectures=["X"])
        config.save_pretrained(tmp_path / model_type)
        dirs.append(str(tmp_path / model_type))
    # Twice: the first process builds transformers' table of model modules and writes it into the
    # cache, the second reads it from there.
    env = {**os.environ, "ENGINE_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        ran = subprocess.run([sys.executable, "-c", _READ, *dirs], capture_output=True, text=True, timeout=300,
                             env=env)
        assert ran.returncode == 0, ran.stderr[-3000:]
        runs.append(json.loads(ran.stdout.strip().splitlines()[-1]))
        written = list((tmp_path / "cache" / "transformers").glob("models-table-*.json"))
        assert len(written) == 1
        if len(runs) == 1:
            first_write = written[0].stat().st_mtime_ns
    assert written[0].stat().st_mtime_ns == first_write  # read back, not built and written again
    import transformers.activations  # noqa: F401  # in already: this process reads them the plain way

    from engine.model_executor.checkpoint import load_hf_config

    for got in runs:
        assert got["activations_before"] is False
        assert got["refused"] is True
        assert got["tables_same"] is True
        for d in dirs:
            assert got["configs"][d] == json.loads(json.dumps(load_hf_config(d).to_dict(), default=str)), d
