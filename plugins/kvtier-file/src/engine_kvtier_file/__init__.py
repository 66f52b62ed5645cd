"""The ``file`` KV storage tier: prefixes evicted from the device KV pool go to a file per rank
under a directory (``--hicache-storage-backend file``, option ``kvtier_file.directory``).

Registration only; the tier lives in ``engine_kvtier_file.tier`` and is imported when selected.
"""

from __future__ import annotations

from engine.hookspecs import KvStorageTierSpec, PluginOption, hookimpl

PLUGIN = "kvtier_file"


@hookimpl
def register_kv_storage_tiers(register):  # type: ignore[no-untyped-def]
    register(KvStorageTierSpec(
        name="file", factory="engine_kvtier_file.tier:FileTier",
        device_types=("cpu", "cuda", "rocm", "xpu", "npu"),
        description="A file per rank under a directory (pread/pwrite of whole slot runs), unlinked once opened"))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption(PLUGIN, "directory", "",
                          "Directory the tier's files are created in (default: the system temp directory's "
                          "engine-kvtier); a local SSD or a mounted network file system"))
