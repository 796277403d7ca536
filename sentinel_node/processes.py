"""The process tree, read from ``/proc``: what a node or a test started, and whether it still runs.

Processes are only ever signalled by the pids found here (never by name), and a pid is trusted to name the same
process only together with its start time: a pid seen once may later be reused by an unrelated process.
"""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces and parentheses)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat_fields(int(entry.name))
        if fields is None:
            continue
        try:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
        except (IndexError, ValueError):
            continue
    found, frontier = [], [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), which tells a process from a later one with its pid."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
