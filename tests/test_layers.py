"""Imports run one way (docs/architecture.md section 2): read from the source of every module, imports inside
functions included."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP = (
    "sentinel_node.cli",
    "sentinel_node.demo",
    "sentinel_node.bench",
    "sentinel_node.supervisor",
    "sentinel_node.sim",
)


def imports(path: Path) -> set[str]:
    """Every module name an ``import`` or ``from ... import`` statement in ``path`` names (relative ones resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                found.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                found.add(node.module)
    return found


def modules(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def named(name: str, *prefixes: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


@pytest.mark.parametrize(
    ("folders", "forbidden"), [(("dht",), ("peers", "sentinel_node")), (("peers",), ("sentinel_node",))]
)
def test_the_lower_packages_know_nothing_of_the_ones_above(folders, forbidden):
    offenders = {
        str(p.relative_to(ROOT)): sorted(n for n in imports(p) if named(n, *forbidden)) for p in modules(*folders)
    }
    assert {p: names for p, names in offenders.items() if names} == {}


def test_roles_pipeline_transport_and_verification_never_import_the_cli_demo_or_benches():
    below = ("sentinel_node/roles", "sentinel_node/pipeline", "sentinel_node/transport", "sentinel_node/verification")
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in imports(p) if named(n, *TOP)) for p in modules(*below)}
    assert {p: names for p, names in offenders.items() if names} == {}


def test_verification_depends_on_torch_numpy_and_the_standard_library_alone():
    allowed = ("torch", "numpy", "sentinel_node.verification", "__future__")
    offenders = {}
    for path in modules("sentinel_node/verification"):
        outside = sorted(
            n for n in imports(path) if not named(n, *allowed) and n.split(".")[0] not in sys.stdlib_module_names
        )
        if outside:
            offenders[str(path.relative_to(ROOT))] = outside
    assert offenders == {}


def test_the_checker_sees_relative_and_nested_imports(tmp_path):
    # the rule above would pass vacuously if imports() missed imports inside functions
    names = imports(ROOT / "sentinel_node" / "config.py")
    assert "peers" in names  # imported inside SwarmConfig.exclusion_params
