"""``sentinel-node plan``, ``export`` and ``tokenizer train``: sizing, importing and exporting real models."""

from __future__ import annotations

import click

from sentinel_node.cli.options import initial_peers_option, load, maddrs


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Swarm config YAML (default: tiny).")
@click.option(
    "--step-seconds", type=click.FloatRange(min=0.001), default=60.0, show_default=True, help="Pace for bandwidth."
)
@click.option("--inflight", type=click.IntRange(min=1), help="Microbatches in flight (default: a step's).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the tables.")
def plan(config_path, step_seconds, inflight, as_json) -> None:
    """What each stage needs (parameters, memory in bf16 and fp32, the smallest GPU) and each boundary's traffic."""
    import json

    from sentinel_node.model.plan import plan as make_plan
    from sentinel_node.model.plan import render

    result = make_plan(load(config_path), step_seconds=step_seconds, inflight=inflight)
    click.echo(json.dumps(result.as_dict(), indent=2, default=list) if as_json else render(result))


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="The swarm's config YAML.")
@click.option(
    "--from",
    "state_dirs",
    multiple=True,
    type=click.Path(file_okay=False),
    help="A stage's --state-dir (repeat, one or more per stage).",
)
@initial_peers_option
@click.option("--out", required=True, type=click.Path(), help="New folder for the Hugging Face checkpoint.")
@click.option(
    "--timeout", type=click.FloatRange(min=1), default=120.0, show_default=True, help="Seconds per download."
)
def export(config_path, state_dirs, initial_peers, out, timeout) -> None:
    """Assemble the stages' latest states into a checkpoint LlamaForCausalLM.from_pretrained loads."""
    from sentinel_node.model.weights import WeightsError
    from sentinel_node.pipeline.checkpoint import CheckpointError
    from sentinel_node.pipeline.export import assemble, states_from_dirs
    from sentinel_node.roles.common import NodeError

    config = load(config_path)
    if bool(state_dirs) == bool(initial_peers):
        raise click.UsageError("give either --from STATE_DIR... or --initial-peers ADDR (a live swarm)")
    try:
        if state_dirs:
            states = states_from_dirs(config, state_dirs)
        else:
            from sentinel_node.roles.state_download import states_from_peers

            states = states_from_peers(config, maddrs(initial_peers, "--initial-peers"), timeout)
        path = assemble(config, states, out)
    except (WeightsError, CheckpointError, NodeError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {path}: load it with LlamaForCausalLM.from_pretrained({str(path)!r})")


@click.group()
def tokenizer() -> None:
    """Tokenizers for real runs."""


@tokenizer.command("train")
@click.option(
    "--data", "data_path", type=click.Path(), help="Folder or file of .txt/.jsonl/.parquet (default: stdlib)."
)
@click.option("--vocab-size", type=click.IntRange(min=2), required=True, help="Tokens, <|endoftext|> included.")
@click.option("--out", required=True, type=click.Path(), help="New folder for the tokenizer files.")
@click.option("--text-column", default="text", show_default=True, help="The column of text in .jsonl/.parquet.")
@click.option("--max-bytes", type=click.IntRange(min=1), default=256 * 2**20, show_default=True, help="Text read.")
def tokenizer_train(data_path, vocab_size, out, text_column, max_bytes) -> None:
    """Train a byte-level BPE tokenizer on your own text; AutoTokenizer.from_pretrained(OUT) loads it."""
    from sentinel_node.data import DataError, train_tokenizer
    from sentinel_node.data.sources import iter_texts, shards_of

    try:
        shards = shards_of(data_path, None, None, "train", text_column)
        trained = train_tokenizer(iter_texts(shards, max_bytes), vocab_size, out)
    except DataError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote a byte-level BPE of {trained.vocab_size} tokens to {out} (set data.tokenizer: {out})")
