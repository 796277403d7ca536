"""The `sentinel-node` command: parse, build a config, call. No logic lives here."""

from __future__ import annotations

import click

from sentinel_node.cli.admit import admit
from sentinel_node.cli.join import join
from sentinel_node.cli.model import export, plan, tokenizer
from sentinel_node.cli.options import config_option, load
from sentinel_node.cli.swarm import swarm


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sentinel-node")
def main() -> None:
    """sentinel-node: pipeline-parallel LLM training across untrusted volunteers, kept honest by SENTINEL."""


main.add_command(join)
main.add_command(swarm)
main.add_command(plan)
main.add_command(export)
main.add_command(tokenizer)
main.add_command(admit)


# --- demo: a whole swarm on this machine -----------------------------------------------------------------------


@main.command()
@click.option("--steps", type=click.IntRange(min=1), default=40, show_default=True, help="Global steps to train.")
@click.option(
    "--attack", default="random", show_default=True, help="The attacker's attack (from the catalogue); 'none': none."
)
@click.option(
    "--attack-start", type=click.IntRange(min=0), default=14, show_default=True, help="Step the attacker starts at."
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Default: configs/demo.yaml.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep logs and status files here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the summary, as one JSON object.")
def demo(steps: int, attack: str, attack_start: int, config_path: str | None, workdir: str | None, as_json: bool):
    """Train the tiny model with a local swarm (bootstrap, 3 stages x 2 replicas, 2 verifiers, a trainer) in
    which one replica of the middle stage attacks; show it struck and excluded while the loss keeps falling."""
    from pathlib import Path

    from sentinel_node.demo import DEMO_CONFIG_PATH, DemoSettings, SwarmStartError, render_summary, run_demo

    load(config_path)  # a bad --config fails here, before any process starts
    if attack != "none" and attack_start >= steps:
        raise click.BadParameter(
            f"the attacker would start at step {attack_start} but the demo trains steps 0..{steps - 1}: nothing "
            "would be attacked; lower --attack-start or raise --steps (or pass --attack none)",
            param_hint="--attack-start",
        )
    settings = DemoSettings(
        steps=steps,
        attack=None if attack == "none" else attack,
        attack_start=attack_start,
        config_path=Path(config_path) if config_path else DEMO_CONFIG_PATH,
        workdir=Path(workdir) if workdir else None,
    )
    try:
        result = run_demo(settings, echo=(lambda _: None) if as_json else click.echo)
    except SwarmStartError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        click.echo("demo interrupted: every process it started has been stopped", err=True)
        raise SystemExit(130) from None
    if as_json:
        click.echo(result.summary.model_dump_json())
    else:
        click.echo(render_summary(result.summary))


# --- simulate and bench: the in-process mesh and the measured figures ----------------------------------------------


def _attack_choice():
    from sentinel_node.attacks import ATTACK_NAMES

    return click.Choice(sorted(ATTACK_NAMES))


@main.command()
@config_option
@click.option("--attack", type=_attack_choice(), help="Attack the malicious replicas run (default: none).")
@click.option(
    "--attack-file",
    help="A red team's own attack: PATH.py:NAME, a function (tensor, step, state) or a StageAttack subclass.",
)
@click.option(
    "--target", type=click.Choice(["activation", "gradient", "both"]), default="activation", show_default=True
)
@click.option("--steps", type=click.IntRange(min=1), help="Global steps (default: the config's sim.steps).")
@click.option("--attack-start", type=click.IntRange(min=0), help="Step the attackers start at.")
@click.option("--no-verify", is_flag=True, help="Run without SENTINEL (verifiers relay only).")
@click.option("--data", type=click.Path(file_okay=False), help="A folder of your own text files to train on.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def simulate(config_path, attack, attack_file, target, steps, attack_start, no_verify, data, as_json) -> None:
    """Train a DP x PP mesh in this process, with SENTINEL verifiers and attacking replicas, and show it live."""
    import json

    from sentinel_node.attacks import AttackError
    from sentinel_node.sim.run import simulate as run_simulation

    config = load(config_path)
    sim = {k: v for k, v in {"steps": steps, "attack_start": attack_start}.items() if v is not None}
    overrides = {"sim": sim, **({"data": {"path": data}} if data else {})}
    try:
        result = run_simulation(
            config.with_overrides(**overrides),
            attack=attack,
            attack_file=attack_file,
            target=target,
            verify=not no_verify,
            on_line=None if as_json else click.echo,
        )
    except (AttackError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(result, indent=2) if as_json else result["text"])


@main.group()
def bench() -> None:
    """Measured figures: detection (the attack catalogue in the simulator), overhead (a local swarm), soak (churn)."""


@bench.command()
@config_option
@click.option("--quick", is_flag=True, help="The quick profile (the catalogue in about 5 minutes on 2 cores).")
@click.option(
    "--suite",
    type=click.Choice(["catalogue", "sweep", "honest", "sybil"]),
    default="catalogue",
    show_default=True,
    help="catalogue: every attack of the catalogue; sweep: attack families with a strength, F1 and damage per "
    "point; honest: one long run without an attacker (false alarms); sybil: attackers re-joining under fresh "
    "identities, with and without probation.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=2),
    help="honest: global steps (default 1000); catalogue, sweep: global steps, the attack starting halfway "
    "(default: the profile's).",
)
@click.option("--attack", "attacks", multiple=True, type=_attack_choice(), help="Only this attack (repeatable).")
@click.option("--family", "families", multiple=True, help="sweep: only this family (repeatable).")
@click.option("--attack-file", help="A red team's own attack, PATH.py:NAME; run on activations and on gradients.")
@click.option(
    "--target",
    "targets",
    multiple=True,
    type=click.Choice(["activation", "gradient"]),
    help="Only runs on this target (repeatable; stage-level attacks always run on both).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/bench", show_default=True, help="PNGs, JSON.")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True, help="Runs in parallel.")
def detection(
    config_path, quick, suite, steps, attacks, families, attack_file, targets, as_json, out, workers
) -> None:
    """SENTINEL against attacks in the simulator: worker-level F1, time to ban, flags, validation loss."""
    import json
    import sys
    from pathlib import Path

    from sentinel_node.attacks import AttackError
    from sentinel_node.bench import detection as catalogue
    from sentinel_node.bench import honest, sweep, sybil

    if suite != "catalogue" and (attacks or attack_file or targets):
        raise click.UsageError("--attack, --attack-file and --target choose catalogue runs (--suite catalogue)")
    if suite != "sweep" and families:
        raise click.UsageError("--family chooses sweep families; add --suite sweep")
    if suite == "sybil" and steps:
        raise click.UsageError("--steps sets the length of an honest, catalogue or sweep run, not of --suite sybil")
    config = load(config_path)
    profile = "quick" if quick else "full"
    echo = None if as_json else lambda line: click.echo(line, err=True)
    bar = not as_json and sys.stderr.isatty()
    try:
        if suite == "sweep":
            report = sweep.run_sweep(
                config, profile, list(families) or None, workers, progress=echo, bar=bar, steps=steps
            )
        elif suite == "honest":
            report = honest.run_honest(config, profile, steps or 1000, progress=echo)
        elif suite == "sybil":
            report = sybil.run_sybil(config, profile, workers, progress=echo, bar=bar)
        else:
            report = catalogue.run_detection(
                config,
                profile,
                list(attacks) or None,
                attack_file,
                workers,
                progress=echo,
                bar=bar,
                targets=list(targets) or None,
                steps=steps,
            )
    except (AttackError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    # per suite: the module that tables and plots its report, the report's file, and its rows (curves left out of
    # the printed JSON; they are in the file)
    module, name, rows = {
        "sweep": (sweep, "sweep.json", "points"),
        "honest": (honest, "honest.json", None),
        "sybil": (sybil, "sybil.json", None),
        "catalogue": (catalogue, "detection.json", "attacks"),
    }[suite]
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = module.plot(report, out_dir)
    (out_dir / name).write_text(json.dumps(report, indent=2))
    printable = dict(report)
    if rows is not None:
        printable[rows] = [{k: v for k, v in r.items() if k not in ("curves", "timeline")} for r in report[rows]]
        printable["clean"] = {k: v for k, v in report["clean"].items() if k != "curve"}
    click.echo(json.dumps(printable, indent=2) if as_json else module.table(report))
    if not as_json:
        click.echo(f"{'plots and ' if plots else ''}{name} in {out_dir}/")


@bench.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Default: configs/demo.yaml.")
@click.option(
    "--steps", type=click.IntRange(min=6), default=33, show_default=True, help="Steps, cycling the three modes."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/bench", show_default=True, help="JSON here.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep the swarm's logs and status files here.")
@click.option(
    "--wire-dtype",
    "wire_dtypes",
    multiple=True,
    type=click.Choice(["float32", "bfloat16", "float16"]),
    help="One swarm per wire dtype, in order (repeatable; default: float32 then bfloat16).",
)
def overhead(config_path, steps, as_json, out, workdir, wire_dtypes) -> None:
    """SENTINEL's cost on a local swarm: tokens/s verified vs plain relays vs duplicate computation, and the
    verifier's CPU time per checked tensor against the forward pass that produced it; per wire dtype, with the
    bytes a microbatch puts on the wire."""
    import json
    from pathlib import Path

    from sentinel_node.bench.overhead import OverheadSettings, run_overhead, table, write_report
    from sentinel_node.demo import DEMO_CONFIG_PATH
    from sentinel_node.roles.common import NodeError
    from sentinel_node.supervisor import SwarmStartError

    load(config_path)
    settings = OverheadSettings(
        steps=steps,
        config_path=Path(config_path) if config_path else DEMO_CONFIG_PATH,
        workdir=Path(workdir) if workdir else None,
        **({"wire_dtypes": tuple(wire_dtypes)} if wire_dtypes else {}),
    )
    try:
        report = run_overhead(settings, echo=lambda line: click.echo(line, err=True))
    except (SwarmStartError, NodeError) as e:
        raise click.ClickException(str(e)) from None
    path = write_report(report, Path(out))
    click.echo(json.dumps(report, indent=2) if as_json else table(report))
    if not as_json:
        click.echo(f"{path} written")


@bench.command()
@click.option(
    "--minutes", type=click.FloatRange(min=0.5), default=30.0, show_default=True, help="Faults for this long."
)
@click.option("--interval", type=click.FloatRange(min=5), default=60.0, show_default=True, help="Seconds per fault.")
@click.option("--seed", type=int, default=0, show_default=True, help="Of the fault schedule.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Default: configs/demo.yaml.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/soak", show_default=True, help="JSON here.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep the swarm's logs and status files here.")
def soak(minutes, interval, seed, config_path, as_json, out, workdir) -> None:
    """The demo swarm under churn: every INTERVAL seconds a stage replica, verifier or the trainer is SIGKILLed and
    restarted, or SIGSTOPped and continued, an attacker among them. Exits 1 when an invariant fails (the loss did
    not fall, an honest peer was excluded, a microbatch was lost, a process or file descriptor leaked)."""
    import json
    from pathlib import Path

    from sentinel_node.bench.soak import SoakSettings, run_soak, table, write_report
    from sentinel_node.demo import DEMO_CONFIG_PATH
    from sentinel_node.roles.common import NodeError
    from sentinel_node.supervisor import SwarmStartError

    load(config_path)
    try:
        settings = SoakSettings(
            minutes=minutes,
            interval_s=interval,
            seed=seed,
            config_path=Path(config_path) if config_path else DEMO_CONFIG_PATH,
            workdir=Path(workdir) if workdir else None,
        )
        report = run_soak(settings, echo=lambda line: click.echo(line, err=True))
    except (SwarmStartError, NodeError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    path = write_report(report, Path(out))
    click.echo(json.dumps(report.as_dict(), indent=2, default=str) if as_json else table(report))
    if not as_json:
        click.echo(f"{path} written")
    if not report.ok:
        raise SystemExit(1)


def _shape(value: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(part) for part in value.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise click.BadParameter(f"{value!r}: give batch,tokens,hidden, e.g. 8,64,128", param_hint="--shape")
    return shape


@bench.command("verifier")
@config_option
@click.option("--device", default="cpu", show_default=True, help="Where the checks run: cpu, cuda or cuda:N.")
@click.option(
    "--wire-dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    help="dtype of the checked tensors (default: the config's pipeline.wire_dtype).",
)
@click.option(
    "--shape", "shapes", multiple=True, help="batch,tokens,hidden (repeatable; default: 8,64,128 to 2,1024,4096)."
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=1, show_default=True, help="torch threads (a verifier uses 1)."
)
@click.option("--repeats", type=click.IntRange(min=3), default=12, show_default=True, help="Timed checks per shape.")
@click.option("--accuracy", is_flag=True, help="Also compare the randomized spectral share with the exact one.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the tables.")
def verifier_bench(config_path, device, wire_dtype, shapes, threads, repeats, accuracy, as_json) -> None:
    """What one check costs per shape and direction: ms, MiB/s, ratio to a memory copy, the tensor's transfer
    time at 100 Mbit/s and 1 Gbit/s, and the time of each stage of the profile."""
    import json

    from sentinel_node.bench.verifier import (
        SHAPES,
        VerifierBenchSettings,
        accuracy_table,
        run_verifier_bench,
        spectral_accuracy,
        table,
    )
    from sentinel_node.pipeline.device import DeviceError

    config = load(config_path)
    settings = VerifierBenchSettings(
        shapes=tuple(_shape(s) for s in shapes) or SHAPES,
        device=device,
        wire_dtype=wire_dtype or config.pipeline.wire_dtype,
        repeats=repeats,
        threads=threads,
    )
    try:
        report = run_verifier_bench(
            config, settings, echo=lambda line: None if as_json else click.echo(line, err=True)
        )
    except DeviceError as e:
        raise click.ClickException(str(e)) from None
    if accuracy:
        report["accuracy"] = spectral_accuracy(config)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(table(report))
    if accuracy:
        click.echo("")
        click.echo(accuracy_table(report["accuracy"]))
