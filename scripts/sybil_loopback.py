"""A re-joining attacker on loopback, with and without probation (issue 14, item 3; docs/reliability.md).

The demo's swarm (bootstrap, 3 stages x 2 replicas, 2 trusted verifiers, a trainer) with one stage 1 replica
sending random activations. Each time it is excluded, it is stopped and started again at once under a fresh identity
(same arguments, a new key), attacking from its first microbatch, as a Sybil would. For each of its lives the script
reports the global steps it lasted from the step it served again to its exclusion, the microbatches it forwarded
(its status file), and the flags and checks in the verifiers' strike records about it. Run it twice:

    PYTHONPATH=. .venv/bin/python scripts/sybil_loopback.py --probation 100 --lives 4 > with.json
    PYTHONPATH=. .venv/bin/python scripts/sybil_loopback.py --probation 0 --lives 4 > without.json

It stops every process it started (the demo's LocalSwarm), on success, failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

from dht import create_identity_file
from sentinel_node.config import load_config
from sentinel_node.demo import DEMO_CONFIG_PATH, Demo, DemoSettings
from sentinel_node.roles.status import StageStatus, VerifierStatus


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probation", type=int, required=True, help="verification.probation (0: none)")
    parser.add_argument("--lives", type=int, default=4, help="identities the attacker takes after its first")
    parser.add_argument("--steps", type=int, default=600, help="global steps the trainer runs at most")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sybil-"))
    config = load_config(DEMO_CONFIG_PATH).with_overrides(verification={"probation": args.probation})
    config_path = workdir / "base.yaml"
    workdir.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
    settings = DemoSettings(
        steps=args.steps,
        attack="random",
        attack_target="activation",
        config_path=config_path,
        workdir=workdir,
        start_timeout=900.0,  # a loaded machine
    )
    lives: list[dict] = []
    with Demo(settings, echo=lambda line: print(line, file=sys.stderr)) as demo:
        demo.start()
        attacker = {"name": demo.attacker_name(), "peer": demo.attacker, "since": settings.attack_start}

        def on_step(record: dict) -> None:
            if attacker["peer"] not in record["excluded"] or len(lives) > args.lives:
                return
            node = demo.swarm.nodes[attacker["name"]]
            status = node.status()
            lives.append(
                {
                    "identity": attacker["peer"],
                    "served_from_step": attacker["since"],
                    "excluded_at_step": record["step"],
                    "steps": record["step"] - attacker["since"],
                    "served": status.served if isinstance(status, StageStatus) else None,
                    **_evidence(demo, attacker["peer"]),
                }
            )
            if len(lives) > args.lives:
                raise _Done  # every life measured: the rest of the training would tell nothing more
            demo.swarm.kill(attacker["name"])
            name = f"stage1-sybil{len(lives)}"
            create_identity_file(demo.swarm.identity(name))  # a fresh key: a new peer id
            attack = ["--attack", "random", "--attack-target", "activation", "--attack-start", "0"]
            started = demo.swarm.start(name, "stage", "--stage", "1", *attack)
            demo.swarm.wait_ready([started], 900)
            attacker.update(name=name, peer=started.peer_id, since=_serving_step(demo))

        with contextlib.suppress(_Done):  # leaving the Demo stops every node, the trainer with them
            demo.train(on_step=on_step)
    out = {"probation": args.probation, "lives": lives, "first": lives[:1], "later": lives[1:]}
    later = lives[1:]
    if later:
        out["mean_steps_later"] = sum(x["steps"] for x in later) / len(later)
        out["mean_flags_later"] = sum(x["flags"] for x in later) / len(later)
    print(json.dumps(out, indent=2))
    return 0 if len(lives) > args.lives else 1


class _Done(Exception):
    """Raised from the step callback once every life is measured."""


def _serving_step(demo: Demo) -> int:
    """The step the trainer is on (from its metrics file's last step record)."""
    return demo.steps[-1]["step"] if demo.steps else 0


def _evidence(demo: Demo, peer: str) -> dict:
    """The verifiers' counts about ``peer``: flags and checks in the ledgers their status files show."""
    flags = checks = 0
    for name in demo.verifier_names():
        status = demo.swarm.nodes[name].status()
        if isinstance(status, VerifierStatus) and peer in status.ledger:
            flags += status.ledger[peer].flags
            checks += status.ledger[peer].checks
    return {"flags": flags, "checks": checks, "time": time.time()}


if __name__ == "__main__":
    sys.exit(main())
