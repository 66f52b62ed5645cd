from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from engine.errors import ConfigError
from engine.testing import KvStorageTierConformance
from engine.testing.conformance.kv_tier import kit_layout, tier_factory

DIRECTORY = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvtier-file-test-{os.getpid()}")


class TestFileTier(KvStorageTierConformance):
    tier_name = "file"
    plugin_options = {"kvtier_file": {"directory": DIRECTORY}}


def test_the_file_is_in_the_directory_and_leaves_no_name_behind() -> None:
    tier: Any = tier_factory("file", TestFileTier.plugin_options)(kit_layout(), 32)
    try:
        assert os.path.dirname(tier.path) == DIRECTORY and not os.path.exists(tier.path)
        # The descriptor still holds the (sparse) file: records written are read back.
        k, v = tier.read(torch.tensor([1, 2, 3]))
        tier.write(torch.tensor([3, 4, 9]), [t + 1 for t in k], [t + 1 for t in v])
        assert torch.equal(tier.read(torch.tensor([9]))[0][0], k[0][2:] + 1)
        assert os.fstat(tier._fd).st_size == (tier.size + 1) * tier.record
    finally:
        tier.close()
    assert os.listdir(DIRECTORY) == []


def test_unwritable_directory_is_a_config_error(tmp_path: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="kvtier_file.directory: invalid value"):
        tier_factory("file", {"kvtier_file": {"directory": str(blocker / "sub")}})(kit_layout(), 32)
