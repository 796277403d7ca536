"""Helpers for the status page's tests: ``sentinel-node swarm serve`` as a real process, and a real headless
Chromium (Debian's, driven by Python playwright; installed with apt by scripts/ensure_chromium.sh when missing)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sentinel_node.supervisor import CLI

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@contextlib.contextmanager
def status_server(initial_peers: list[str], *args: str, timeout: float = 180.0) -> Iterator[str]:
    """``swarm serve`` on a free port of the loopback, in its own process group; yields its URL once the page
    answers with a read swarm."""
    process = subprocess.Popen(
        [*CLI, "swarm", "serve", "--port", "0", "--initial-peers", *initial_peers, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        deadline, url = time.monotonic() + timeout, None
        while url is None and time.monotonic() < deadline and process.poll() is None:
            with contextlib.suppress(queue.Empty):
                line = lines.get(timeout=0.5)
                if "status page at " in line:
                    url = line.split("status page at ")[1].strip()
        if url is None:
            error = process.stderr.read()[-3000:] if process.poll() is not None else "(still running)"
            raise AssertionError(f"swarm serve did not start ({process.poll()}):\n{error}")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def chromium() -> str:
    """The path of Debian's chromium, installed when missing; skips the test where it cannot be had."""
    result = subprocess.run([str(ROOT / "scripts" / "ensure_chromium.sh")], capture_output=True, text=True)
    if result.returncode == 77:
        pytest.skip(f"no chromium here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def install_chromium_meanwhile() -> threading.Thread:
    """Installs chromium in the background where it is missing (a fresh machine: apt-get, a minute or so), so that a
    test can start its swarm meanwhile rather than keep it running idle while the browser installs; join the thread
    before :func:`browser_page`, whose own check then finds it installed."""
    script = [str(ROOT / "scripts" / "ensure_chromium.sh")]
    thread = threading.Thread(target=subprocess.run, args=(script,), kwargs={"capture_output": True}, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def browser_page(user_data_dir: Path) -> Iterator[object]:
    """A playwright page of a fresh headless Chromium profile."""
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = chromium()
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(user_data_dir),
            executable_path=executable,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield context.new_page()
        finally:
            context.close()
