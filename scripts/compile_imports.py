"""Byte-compiles what sentinel-node's commands import, and the project's own packages: the image's last build step
(Dockerfile), after `pip install --no-compile`.

pip compiles every file it installs, one after another: 14,500 files and 360 MB of bytecode for this project's
dependencies, of which a node imports about 1,900 (torch, hivemind, transformers' Llama, ...). A container runs as a
user who cannot write to the venv, so what is not compiled at build time is compiled again, in memory, by every
process that imports it; importing is what decides which modules those are, so this imports them (as the build's
root user, with bytecode writing on whatever the environment says). Modules imported later, on a path a command
takes only sometimes, start a little slower; nothing else changes.

    python scripts/compile_imports.py            # compiles; prints how many modules have bytecode now
    python scripts/compile_imports.py --check    # writes nothing; fails if a module a node imports has none
"""

from __future__ import annotations

import compileall
import importlib
import os
import py_compile
import sys
from pathlib import Path

# Every command's entry and the roles' modules, and what they import only when called: data (datasets, tokenizers),
# checkpoints (safetensors), plots (matplotlib), the status page (uvicorn), real models from the hub.
MODULES = (
    "sentinel_node.cli.main",
    "sentinel_node.roles.bootstrap",
    "sentinel_node.roles.stage",
    "sentinel_node.roles.trainer",
    "sentinel_node.roles.verifier",
    "sentinel_node.demo",
    "sentinel_node.sim.run",
    "datasets",
    "tokenizers",
    "safetensors.torch",
    "matplotlib.pyplot",
    "uvicorn",
    "huggingface_hub",
    "transformers.models.auto.tokenization_auto",
)
# What every node imports: --check wants bytecode for all of it.
NODE_MODULES = MODULES[:5]
PACKAGES = ("sentinel_node", "dht", "peers")


def imported_from_source() -> tuple[list[tuple[str, str]], int]:
    """(source, bytecode path) of each imported module whose bytecode file is missing, and how many imported
    modules have a bytecode path at all."""
    cached = []
    for module in list(sys.modules.values()):
        source, path = getattr(module, "__file__", None), getattr(module, "__cached__", None)
        if isinstance(source, str) and source.endswith(".py") and isinstance(path, str):
            cached.append((source, path))
    return [(source, path) for source, path in cached if not os.path.exists(path)], len(cached)


def compile_all() -> int:
    """Imports MODULES with bytecode writing on, compiles what was imported before this ran (site's .pth hooks)
    and the project's packages; 0 when every imported module has bytecode."""
    sys.dont_write_bytecode = False  # PYTHONDONTWRITEBYTECODE must not leave them uncompiled
    os.environ.setdefault("MPLBACKEND", "Agg")
    for name in MODULES:
        importlib.import_module(name)
    for source, path in imported_from_source()[0]:
        py_compile.compile(source, cfile=path, quiet=1)
    root = Path(__file__).resolve().parent.parent
    ok = all(compileall.compile_dir(root / package, quiet=1) for package in PACKAGES)
    missing, total = imported_from_source()
    print(f"bytecode for {total - len(missing)} of the {total} modules imported, and for {', '.join(PACKAGES)}")
    return 0 if ok and not missing else 1


def check() -> int:
    """Imports what every node imports, writing nothing; 0 when all of it had bytecode (the image's smoke test, as
    the image's user)."""
    sys.dont_write_bytecode = True
    for name in NODE_MODULES:
        importlib.import_module(name)
    missing, total = imported_from_source()
    names = [Path(source).name for source, _ in missing[:5]]
    print(f"bytecode for {total - len(missing)} of the {total} modules a node imports; without: {names}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(check() if sys.argv[1:] == ["--check"] else compile_all())
