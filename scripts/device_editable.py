"""Editable installs of the core and every plugin without pip, for a lent GPU machine.

``pip install -e`` of the ~50 packages takes ~100 s there; this writes what those installs
leave behind in about a second: for each package a ``.pth`` file naming its ``src`` directory and
a ``dist-info`` directory with ``METADATA`` and ``entry_points.txt`` (what plugin discovery
reads), into the interpreter's first site-packages directory. Every package uses setuptools with
a ``src`` layout and a static version, which this relies on. Run from the repository root;
``--check`` (in a fresh interpreter, which reads the new ``.pth`` files) exits 1 unless every
package is found with its entry points and ``engine`` imports from this tree; ``scripts/device_setup.sh``
then falls back to pip.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import site
import sys

import tomllib


def package_dirs() -> list[str]:
    found = glob.glob("plugins*/*/pyproject.toml")
    return ["core"] + sorted(os.path.dirname(p) for p in found if "_template" not in p)


def install(src_root: str, site_dir: str) -> int:
    count = 0
    for d in package_dirs():
        with open(os.path.join(d, "pyproject.toml"), "rb") as f:
            meta = tomllib.load(f)["project"]
        name, version = meta["name"], meta["version"]
        norm = re.sub(r"[-_.]+", "_", name).lower()
        for old in glob.glob(os.path.join(site_dir, f"{norm}-*.dist-info")):
            shutil.rmtree(old)
        for old in glob.glob(os.path.join(site_dir, f"__editable__*{norm}*")):
            os.remove(old)
        info = os.path.join(site_dir, f"{norm}-{version}.dist-info")
        os.makedirs(info)
        requires = "".join(f"Requires-Dist: {dep}\n" for dep in meta.get("dependencies", []))
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}")
        groups = dict(meta.get("entry-points", {}))
        if meta.get("scripts"):
            groups["console_scripts"] = meta["scripts"]
        with open(os.path.join(info, "entry_points.txt"), "w") as f:
            for group, items in groups.items():
                f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n")
        for fname, text in (("INSTALLER", "device_editable\n"), ("RECORD", "")):
            with open(os.path.join(info, fname), "w") as f:
                f.write(text)
        with open(os.path.join(site_dir, f"__editable__.{norm}-{version}.pth"), "w") as f:
            f.write(os.path.join(src_root, d, "src") + "\n")
        count += 1
    return count


def check(src_root: str) -> list[str]:
    """What is missing or wrong after ``install``, as one line each (empty: all there)."""
    import importlib_metadata

    import engine

    problems = []
    if not os.path.realpath(engine.__file__).startswith(os.path.realpath(os.path.join(src_root, "core"))):
        problems.append(f"engine imports from {engine.__file__}")
    for d in package_dirs():
        with open(os.path.join(d, "pyproject.toml"), "rb") as f:
            meta = tomllib.load(f)["project"]
        want = sum(len(items) for items in meta.get("entry-points", {}).values())
        try:
            have = len([ep for ep in importlib_metadata.distribution(meta["name"]).entry_points
                        if ep.group != "console_scripts"])
        except importlib_metadata.PackageNotFoundError:
            problems.append(f"{meta['name']}: not found")
            continue
        if have != want:
            problems.append(f"{meta['name']}: {have} entry points, {want} declared")
    return problems


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        missing = check(os.getcwd())
        print("\n".join(f"device_editable: {line}" for line in missing) or "device_editable: all packages found")
        sys.exit(1 if missing else 0)
    target = site.getsitepackages()[0]
    print(f"device_editable: {install(os.getcwd(), target)} packages into {target}")
