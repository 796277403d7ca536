"""Byte-compiles what sentinel-node's commands import, and the project's own packages: the image's last build step
(Dockerfile), after `pip install --no-compile`.

pip compiles every file it installs, one after another: 14,500 files and 360 MB of bytecode for this project's
dependencies, of which a node imports about 1,900 (torch, hivemind, transformers' Llama, ...). A container runs as a
user who cannot write to the venv, so what is not compiled at build time is compiled again, in memory, by every
process that imports it; importing is what decides which modules those are, so this imports them (as the build's
root user, with bytecode writing on whatever the environment says). Modules imported later, on a path a command
takes only sometimes, start a little slower; nothing else changes.

    python scripts/compile_imports.py      # prints how many modules have bytecode now
"""

from __future__ import annotations

import compileall
import importlib
import os
import py_compile
import sys
from pathlib import Path

sys.dont_write_bytecode = False  # before any import below: PYTHONDONTWRITEBYTECODE must not leave them uncompiled

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
PACKAGES = ("sentinel_node", "dht", "peers")


def main() -> int:
    os.environ.setdefault("MPLBACKEND", "Agg")
    for name in MODULES:
        importlib.import_module(name)
    # what Python imported before this script ran (site's .pth hooks) was not written
    for module in list(sys.modules.values()):
        source, cached = getattr(module, "__file__", None), getattr(module, "__cached__", None)
        written = isinstance(cached, str) and os.path.exists(cached)
        if isinstance(source, str) and source.endswith(".py") and isinstance(cached, str) and not written:
            py_compile.compile(source, cfile=cached, quiet=1)
    root = Path(__file__).resolve().parent.parent
    ok = all(compileall.compile_dir(root / package, quiet=1) for package in PACKAGES)
    cached = [path for m in list(sys.modules.values()) if isinstance(path := getattr(m, "__cached__", None), str)]
    compiled = sum(os.path.exists(path) for path in cached)
    print(f"bytecode for {compiled} of the {len(cached)} modules imported, and for {', '.join(PACKAGES)}")
    return 0 if ok and compiled == len(cached) else 1


if __name__ == "__main__":
    sys.exit(main())
