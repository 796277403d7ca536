"""Hosts of a test's own on one machine: a network namespace per node, joined by veth pairs to a bridge in a hub
namespace, with addresses of the test's own (the hub's net, 11.213.0.0/24), and hosts behind a NAT router on a
private net (10.214.0.0/24, masqueraded to the router's hub address, no inbound port).

The hub's net stands for the internet, so its addresses must look public to libp2p: auto-relay builds a NATed
node's circuit addresses from its relay's public addresses only (go-libp2p's ``cleanupAddressSet`` drops private
ones), so on a private hub no circuit address can appear. The range exists only inside the namespaces below: the
hub has no link to the root namespace, so no packet to or from it can leave them.

Nothing here touches the root namespace's interfaces, routes or firewall: every link, bridge and rule lives inside a
namespace this module created, and :meth:`Network.close` deletes the namespaces (which removes their links and
rules with them). Namespace names carry the test process's pid and a counter, so two runs side by side never share
one. A partition is a firewall rule in the cut host's own namespace that drops everything on its link (both ways);
healing deletes the rule: the node's process, sockets and addresses stay as they were, as when a cable is pulled and
plugged back.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

HUB_NET = "11.213.0"
HIDDEN_NET = "10.214.0"
ROUTER_HUB_IP = f"{HUB_NET}.254"
ROUTER_HIDDEN_IP = f"{HIDDEN_NET}.1"
_networks = itertools.count()


def unavailable() -> str | None:
    """Why this machine cannot build namespaces (not root, no ``ip`` or ``iptables``), or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on this machine"
    probe = f"snprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        rule = subprocess.run(
            ["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L", "-n"], capture_output=True, text=True
        )
        if rule.returncode != 0:
            return f"iptables does not work in a namespace: {rule.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*command: str) -> str:
    """Runs a command; CalledProcessError (with its stderr) when it fails."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
    return done.stdout


@dataclass
class Host:
    name: str
    namespace: str
    ip: str
    hidden: bool  # behind the NAT router
    cut: bool = False

    @property
    def prefix(self) -> list[str]:
        """What runs a command on this host: ``ip netns exec`` execs the command in place, so its pid and process
        group are the command's own (the supervisor stops it by them)."""
        return ["ip", "netns", "exec", self.namespace]

    def run(self, *command: str) -> str:
        return sh(*self.prefix, *command)


class Network:
    """The hub, the NAT router (on first use) and the hosts added to them; a context manager that deletes them all."""

    def __init__(self) -> None:
        self.tag = f"sn{os.getpid()}x{next(_networks)}"
        self.hosts: dict[str, Host] = {}
        self.namespaces: list[str] = []
        self._next_ip = {HUB_NET: 1, HIDDEN_NET: 2}
        self.router: str | None = None
        try:
            self.hub = self._namespace("hub")
            sh(*self._in(self.hub), "ip", "link", "add", "br0", "type", "bridge")
            sh(*self._in(self.hub), "ip", "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _in(self, namespace: str) -> list[str]:
        return ["ip", "netns", "exec", namespace]

    def _namespace(self, name: str) -> str:
        namespace = f"{self.tag}-{name}"
        sh("ip", "netns", "add", namespace)
        self.namespaces.append(namespace)
        sh(*self._in(namespace), "ip", "link", "set", "lo", "up")
        return namespace

    def _link_to_hub(self, namespace: str, ip: str) -> None:
        """A veth pair: eth0 in ``namespace`` (address ``ip``), its other end a port of the hub's bridge. Both ends
        are created inside their namespaces, so no name ever exists in the root namespace."""
        port = f"p{len(self.namespaces)}"
        _veth(namespace, self.hub, port)
        sh(*self._in(self.hub), "ip", "link", "set", port, "master", "br0", "up")
        sh(*self._in(namespace), "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        sh(*self._in(namespace), "ip", "link", "set", "eth0", "up")

    def _address(self, net: str) -> str:
        last = self._next_ip[net]
        if last >= 250:
            raise ValueError(f"no address left on {net}.0/24")
        self._next_ip[net] = last + 1
        return f"{net}.{last}"

    def add(self, name: str, hidden: bool = False, dials: Sequence[str] | None = None) -> Host:
        """A host on the hub's net, or with ``hidden`` behind the NAT router: it can open connections to the hub's
        hosts (masqueraded as the router's address) and nobody there can open one to it. ``dials``: the hub
        addresses a hidden host may open connections to (None: any); the router resets the others at once, as a
        strict firewall does, so the host reaches everyone else only over connections they open through a relay."""
        if name in self.hosts:
            raise ValueError(f"a host named {name} exists already")
        namespace = self._namespace(name)
        if hidden:
            self._ensure_router()
            ip = self._address(HIDDEN_NET)
            # a veth pair straight to the router: the hidden net is the router's own
            port = f"h{len(self.namespaces)}"
            _veth(namespace, self.router, port)
            sh(*self._in(self.router), "ip", "link", "set", port, "master", "brh", "up")
            sh(*self._in(namespace), "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
            sh(*self._in(namespace), "ip", "link", "set", "eth0", "up")
            sh(*self._in(namespace), "ip", "route", "add", "default", "via", ROUTER_HIDDEN_IP)
            if dials is not None:
                rules = [["-s", ip, "-d", allowed, "-j", "ACCEPT"] for allowed in dials]
                rules += [
                    ["-s", ip, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
                    ["-s", ip, "-j", "DROP"],
                ]
                for rule in rules:
                    sh(*self._in(self.router), "iptables", "-A", "FORWARD", *rule)
        else:
            ip = self._address(HUB_NET)
            self._link_to_hub(namespace, ip)
        host = Host(name, namespace, ip, hidden)
        self.hosts[name] = host
        return host

    def _ensure_router(self) -> None:
        if self.router is not None:
            return
        self.router = self._namespace("nat")
        self._link_to_hub(self.router, ROUTER_HUB_IP)
        sh(*self._in(self.router), "ip", "link", "add", "brh", "type", "bridge")
        sh(*self._in(self.router), "ip", "addr", "add", f"{ROUTER_HIDDEN_IP}/24", "dev", "brh")
        sh(*self._in(self.router), "ip", "link", "set", "brh", "up")
        sh(*self._in(self.router), "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = [
            # out: masqueraded as the router's hub address
            ["-t", "nat", "-A", "POSTROUTING", "-s", f"{HIDDEN_NET}.0/24", "-o", "eth0", "-j", "MASQUERADE"],
            # in: only the answers to connections the hidden hosts opened (no port forwarded, as a home router)
            ["-A", "FORWARD", "-i", "eth0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
            ["-A", "FORWARD", "-i", "eth0", "-j", "DROP"],
        ]
        for rule in rules:
            sh(*self._in(self.router), "iptables", *rule)

    def cut(self, name: str) -> None:
        """Partitions host ``name`` from everyone: every packet on its link is dropped, both ways."""
        host = self.hosts[name]
        for rule in _cut_rules():
            host.run("iptables", "-I", *rule)
        host.cut = True

    def heal(self, name: str) -> None:
        host = self.hosts[name]
        for rule in _cut_rules():
            host.run("iptables", "-D", *rule)
        host.cut = False

    def close(self) -> None:
        """Deletes every namespace this network made (their links, bridges and rules go with them). Processes
        still running in one keep it alive until they exit: stop them first."""
        for namespace in reversed(self.namespaces):
            with contextlib.suppress(subprocess.CalledProcessError):
                sh("ip", "netns", "del", namespace)
        self.namespaces.clear()

    def leftovers(self) -> list[str]:
        """This network's namespaces that still exist (none after :meth:`close`)."""
        listed = sh("ip", "netns", "list")
        return [line.split()[0] for line in listed.splitlines() if line.startswith(f"{self.tag}-")]


def _veth(namespace: str, other: str, port: str) -> None:
    """A veth pair created with its ends already in their namespaces: eth0 in ``namespace``, ``port`` in ``other``."""
    sh("ip", "link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", port, "netns", other)


def _cut_rules() -> Sequence[list[str]]:
    return (["INPUT", "-i", "eth0", "-j", "DROP"], ["OUTPUT", "-o", "eth0", "-j", "DROP"])
