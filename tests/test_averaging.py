"""The replicas' averager over a real DHT and p2pd: what it leaves behind when it stops."""

from __future__ import annotations

from pathlib import Path

import hivemind
import torch

from sentinel_node.roles.averaging import ExcludingAverager


def listening_paths(pid: int) -> list[Path]:
    """The filesystem paths of the unix sockets process ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            inodes.add(str(fd.readlink())[len("socket:[") : -1])
        except FileNotFoundError:  # closed since the listing: a socket it no longer holds
            continue
    rows = [line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:]]
    return [Path(row[7]) for row in rows if len(row) >= 8 and row[6] in inodes and row[7].startswith("/")]


def test_a_stopped_averager_leaves_no_socket_file_behind():
    """hivemind's averager process opens its own handle on the DHT's p2pd, which listens on a unix socket in /tmp,
    and its shutdown never closed it: every stage replica stopped left one file behind."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        averager = ExcludingAverager([torch.zeros(4)], dht, start=True, prefix="stop_test", min_group_size=2)
        try:
            averager.wait_until_ready(60)
            sockets = [path for path in listening_paths(averager.pid) if path.name.startswith("hivemind-")]
            assert sockets and all(path.exists() for path in sockets), sockets
        finally:
            averager.shutdown()
        assert not averager.is_alive()
        assert [path for path in sockets if path.exists()] == []
    finally:
        dht.shutdown()
