"""The container image: scripts/image_smoke.sh builds the Dockerfile's cpu variant with buildah (on a minimal Debian
base made by mmdebstrap, from a wheelhouse of this machine's pip) and runs it: ``sentinel-node --help``, then
docker-compose.yml's bootstrap and verifier0 services, each in a container of the image, with real hivemind DHTs
and p2pd daemons, checked with ``sentinel-node swarm status`` and their metrics.

It takes about four minutes, mostly downloads, pip installs and the image commit; ``make test`` runs it beside
the rest of the suite (marker ``image``). It is skipped only where buildah cannot run at all (the script exits 77:
not root, no apt to install buildah and mmdebstrap, no mount namespaces).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "image_smoke.sh"
SKIPPED = 77  # the script's exit status where buildah cannot run here
TIMEOUT_S = 900


def _run_script() -> tuple[int, str]:
    """Runs the script in its own process group; past TIMEOUT_S the whole group gets SIGTERM (the script then removes
    its work folder), then SIGKILL."""
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"scripts/image_smoke.sh ran past {TIMEOUT_S}s:\n{output}")
    print(output)  # pytest -rA shows it for a pass too: the measured times
    return proc.returncode, output


def _lines(output: str, prefix: str) -> list[str]:
    """What follows ``SMOKE <prefix>`` on each line that starts so."""
    start = f"SMOKE {prefix}"
    return [line[len(start) :].strip() for line in output.splitlines() if line.startswith(start)]


def _line(output: str, prefix: str) -> str:
    found = _lines(output, prefix)
    assert found, f"no 'SMOKE {prefix}' line in:\n{output}"
    return found[-1]


@pytest.mark.slow
@pytest.mark.image
@pytest.mark.timeout(TIMEOUT_S + 120)
def test_image_builds_and_runs_a_swarm():
    returncode, output = _run_script()
    if returncode == SKIPPED:
        pytest.skip(f"buildah cannot run on this machine: {_line(output, 'SKIP')}")
    assert returncode == 0, f"scripts/image_smoke.sh failed ({returncode}):\n{output}"

    assert _line(output, "OK").startswith("total=")
    # the cpu variant: torch's CPU build, hivemind from its wheel
    assert _line(output, "run versions:") == "torch 2.13.0+cpu hivemind 1.1.12 cuda None"
    # the image's config: the entry point, its default command, the unprivileged user, the volume and the ports
    config = {key: json.loads(value) for key, value in (line.split("=", 1) for line in _lines(output, "config "))}
    assert config == {
        "Entrypoint": ["sentinel-node"],
        "Cmd": ["--help"],
        "User": "sentinel",
        "WorkingDir": "/data",
        "Volumes": ["/data"],
        "ExposedPorts": ["31337/tcp", "9400/tcp"],
    }
    assert _line(output, "run id:") == "sentinel:sentinel, HOME=/data, data owned by sentinel"
    assert "join, demo, simulate, swarm, bench" in _line(output, "run help:")
    # docker-compose.yml's bootstrap and verifier0, each in a container of the image: the verifier found the
    # bootstrap through /swarm/initial-peers (no loopback address in it), and the DHT knows both
    peers = _line(output, "compose initial-peers:").split()
    assert peers and all(re.fullmatch(r"/ip[46]/[^ ]+/tcp/\d+/p2p/\w+", p) and "/ip4/127." not in p for p in peers)
    up = re.fullmatch(r"\(\d+s\): bootstrap (\w+), verifier (\w+)", _line(output, "compose nodes up"))
    assert up, output
    boot, verifier = up.groups()
    assert all(p.endswith(f"/p2p/{boot}") for p in peers)
    assert _line(output, "compose swarm status:") == f"bootstrap {boot} online, verifier {verifier} online"
    metrics = _lines(output, "compose metrics:")
    assert any('role="bootstrap"' in m and boot in m for m in metrics), metrics
    assert any('role="verifier"' in m and verifier in m for m in metrics), metrics
