"""``sentinel-node admit``: the organiser's command, to create its key and to admit trainers and verifiers."""

from __future__ import annotations

import click

from sentinel_node.cli.options import config_option, load


@click.command()
@config_option
@click.option("--new-organiser-key", "new_key", type=click.Path(dir_okay=False), help="Create the organiser key here.")
@click.option("--role", type=click.Choice(["trainer", "verifier"]), help="The role to admit the peer to.")
@click.option("--peer", help="The peer id to admit (what the node printed when it started).")
@click.option("--boundaries", help="verifier: only these boundaries, e.g. 0,1 (default: every boundary).")
@click.option("--days", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True)
@click.option("--key", "key_path", type=click.Path(dir_okay=False), help="The organiser key file.")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the certificate here (default: print it).")
def admit(config_path, new_key, role, peer, boundaries, days, key_path, out) -> None:
    """Admit a trainer or verifier to the swarm with a certificate signed by the organiser key, or create that
    key (--new-organiser-key FILE) and print the config line that names it."""
    from dht import AdmissionError
    from sentinel_node.organiser import admit as issue
    from sentinel_node.organiser import config_line, new_organiser_key, write_certificate

    try:
        if new_key:
            identity = new_organiser_key(new_key)
            click.echo(f"created the organiser key {new_key}; keep it private. Put this in the swarm config:")
            click.echo(config_line(identity))
            return
        if not (role and peer and key_path):
            raise click.UsageError("pass --role, --peer and --key (or --new-organiser-key FILE)")
        try:
            bounds = None if boundaries is None else [int(b) for b in boundaries.replace(",", " ").split()]
        except ValueError:
            raise click.BadParameter("integers, e.g. --boundaries 0,1", param_hint="--boundaries") from None
        certificate = issue(load(config_path), key_path, role, peer, bounds, days)
    except AdmissionError as e:
        raise click.ClickException(str(e)) from None
    if out:
        write_certificate(certificate, out)
        click.echo(f"admitted {peer} as {role}; the node joins with --certificate {out}")
    else:
        click.echo(certificate.to_file(), nl=False)
