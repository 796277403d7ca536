"""Hugging Face Llama checkpoints in and out: one explicit name mapping between a stage's parameters and the
checkpoint's, used by both :func:`load_pretrained` (``model.init_from``) and :func:`export_checkpoint`.

=====================================  ==========================================
stage parameter                        Hugging Face LlamaForCausalLM
=====================================  ==========================================
``embed.weight`` (stage 0)             ``model.embed_tokens.weight``
``layers.{i}.{rest}``                  ``model.layers.{first layer of the stage + i}.{rest}``
``norm.weight`` (last stage)           ``model.norm.weight``
``head.weight`` (last stage)           ``lm_head.weight``
=====================================  ==========================================

Tied embeddings: a checkpoint with ``tie_word_embeddings`` (Llama 3.2 1B/3B) stores no ``lm_head.weight``; the last
stage then starts its head from ``model.embed_tokens.weight``. From there the swarm trains the two apart (they live
on different machines, and keeping them equal would need a gradient exchange between the first and the last
stage), so an exported checkpoint always has its own ``lm_head.weight`` and ``tie_word_embeddings: false``.

Loading is lazy: a stage opens only the safetensors files that hold its own tensors (``safe_open``), checks every
name and shape against the config before reading any tensor, and reads only its own, so its memory is its slice of
the model. From the hub, only those files are downloaded.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind.utils import get_logger

from sentinel_node.config import Config, ModelConfig
from sentinel_node.model.plan import layer_range
from sentinel_node.model.stage import llama_config, rope_parameters

logger = get_logger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHARD_BYTES = 4 * 2**30  # exported shards are at most this large
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")  # old checkpoints saved this buffer; it is recomputed


class WeightsError(ValueError):
    """A checkpoint does not fit the config, or cannot be read or written; the message says what differs."""


# --- the name mapping


def to_hf(name: str, first_layer: int) -> str:
    """A stage parameter's name in a Hugging Face checkpoint (``first_layer``: the stage's first global layer)."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "head.weight":
        return "lm_head.weight"
    match = _LAYER.match(name)
    if match is None:
        raise KeyError(f"no Hugging Face name for stage parameter {name!r}")
    return f"model.layers.{first_layer + int(match.group(1))}.{match.group(2)}"


def from_hf(name: str, layers: range) -> str | None:
    """The stage parameter a checkpoint name maps to, None when it belongs to another stage."""
    if name == "model.embed_tokens.weight":
        return "embed.weight" if layers.start == 0 else None
    if name in ("model.norm.weight", "lm_head.weight"):
        return None  # the caller knows whether it is the last stage
    match = _HF_LAYER.match(name)
    if match is None or int(match.group(1)) not in layers:
        return None
    return f"layers.{int(match.group(1)) - layers.start}.{match.group(2)}"


def stage_hf_names(m: ModelConfig, stage: int, n_stages: int, local_names: list[str]) -> dict[str, str]:
    """local name -> checkpoint name for every tensor of a stage."""
    first = layer_range(m.n_layers, stage, n_stages).start
    return {name: to_hf(name, first) for name in local_names}


# --- the checkpoint's config


def _hf_config(directory: Path, origin: str) -> dict:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except OSError:
        raise WeightsError(f"{origin} has no config.json; give a folder saved with save_pretrained") from None
    except ValueError as e:
        raise WeightsError(f"{origin}: config.json is not valid JSON ({e})") from None
    if raw.get("model_type") != "llama":
        raise WeightsError(
            f"{origin} holds a {raw.get('model_type')!r} model; model.init_from takes a Llama checkpoint"
        )
    from transformers import LlamaConfig

    return LlamaConfig.from_dict(raw).to_dict()


def config_differences(m: ModelConfig, hf: Mapping) -> list[str]:
    """Where the checkpoint's config and the swarm's model config disagree, as 'field: config X, checkpoint Y'."""
    ours = {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads or m.n_heads,
        "head_dim": m.hidden_size // m.n_heads,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
    }
    names = {
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "head_dim": "hidden_size / n_heads",
    }
    problems = []
    for key, value in ours.items():
        theirs = hf.get(key, value)
        if theirs is None and key == "num_key_value_heads":
            theirs = hf.get("num_attention_heads")
        if theirs != value:
            problems.append(f"{names.get(key, key)}: config {value}, checkpoint {theirs}")
    if abs(float(hf.get("rms_norm_eps", m.rms_norm_eps)) - m.rms_norm_eps) > 1e-12:
        problems.append(f"rms_norm_eps: config {m.rms_norm_eps}, checkpoint {hf.get('rms_norm_eps')}")
    theirs_rope = dict(hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta")})
    mine_rope = rope_parameters(m)
    for key in sorted(set(theirs_rope) | set(mine_rope)):
        a, b = mine_rope.get(key), theirs_rope.get(key)
        if a != b and not (isinstance(a, int | float) and isinstance(b, int | float) and abs(a - b) < 1e-9):
            label = "rope_theta" if key == "rope_theta" else f"rope_scaling.{key}"
            problems.append(f"{label}: config {a}, checkpoint {b}")
    return problems


# --- where the checkpoint's tensors are


@dataclass(frozen=True)
class CheckpointFiles:
    directory: Path
    weight_map: dict[str, str]  # tensor name -> file name (relative to directory)
    tied: bool  # tie_word_embeddings: no lm_head.weight of its own


def _weight_map(directory: Path, origin: str) -> dict[str, str]:
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{origin}: {INDEX_FILE} is unreadable ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{origin}: {INDEX_FILE} has no weight_map")
        return weight_map
    single = directory / SINGLE_FILE
    if single.exists():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
        except Exception as e:  # a damaged header
            raise WeightsError(f"{origin}: {SINGLE_FILE} is not a safetensors file ({e})") from None
    raise WeightsError(
        f"{origin} holds no {SINGLE_FILE} nor {INDEX_FILE}; give a Hugging Face checkpoint saved as safetensors"
    )


def _resolve(source: str, needed_files) -> Path:
    """The local folder of ``source``; a hub id is downloaded (only config, index and ``needed_files(index)``)."""
    from sentinel_node.data import hub

    if hub.is_local(source):
        directory = Path(source).expanduser()
        if not directory.is_dir():
            raise WeightsError(f"model.init_from {source} is not a folder; give the folder save_pretrained wrote")
        return directory
    from sentinel_node.data import DataError

    try:
        hub.require_hub("model.init_from", source)
    except DataError as e:
        raise WeightsError(str(e)) from None
    from huggingface_hub import snapshot_download

    try:
        cached = hub.offline()  # the libraries read HF_HUB_OFFLINE once, when imported: say it again
        directory = Path(
            snapshot_download(source, allow_patterns=["config.json", INDEX_FILE], local_files_only=cached)
        )
        files = needed_files(directory) if (directory / INDEX_FILE).exists() else [SINGLE_FILE]
        return Path(
            snapshot_download(source, allow_patterns=["config.json", INDEX_FILE, *files], local_files_only=cached)
        )
    except Exception as e:  # not found, gated, unreachable
        raise WeightsError(f"model.init_from {source!r} cannot be downloaded: {type(e).__name__}: {e}") from None


# --- in


def stage_source_names(config: Config, stage: int, files: CheckpointFiles) -> dict[str, str]:
    """local name -> checkpoint name to read, for every parameter of the stage (the head of a tied checkpoint
    reads the embedding)."""
    from sentinel_node.model.stage import build_stage

    n = config.pipeline.n_stages
    local = list(build_stage(config.model, stage, n, device="meta").state_dict())
    names = stage_hf_names(config.model, stage, n, local)
    if "head.weight" in names and files.tied and "lm_head.weight" not in files.weight_map:
        names["head.weight"] = "model.embed_tokens.weight"
    return names


def load_pretrained(module: torch.nn.Module, config: Config, stage: int, source: str) -> None:
    """Fills stage ``stage``'s ``module`` from the checkpoint at ``source`` (folder or hub id); WeightsError, with
    every difference named, before any parameter changes when the checkpoint does not fit the config."""
    origin = f"model.init_from {source}"

    def needed(directory: Path) -> list[str]:
        tied = bool(_hf_config(directory, origin).get("tie_word_embeddings"))
        files = CheckpointFiles(directory, _weight_map(directory, origin), tied)
        names = stage_source_names(config, stage, files).values()
        return sorted({files.weight_map[name] for name in names if name in files.weight_map})

    directory = _resolve(source, needed)
    hf = _hf_config(directory, origin)
    problems = config_differences(config.model, hf)
    if problems:
        raise WeightsError(f"{origin} does not match the swarm's model config: " + "; ".join(problems))
    files = CheckpointFiles(directory, _weight_map(directory, origin), bool(hf.get("tie_word_embeddings")))
    names = stage_source_names(config, stage, files)
    _check_unexpected(files, config, stage, origin)
    missing = sorted(hf_name for hf_name in names.values() if hf_name not in files.weight_map)
    if missing:
        raise WeightsError(
            f"{origin} lacks {len(missing)} tensor(s) stage {stage} needs: {', '.join(missing[:6])}"
            + (" ..." if len(missing) > 6 else "")
        )
    state = module.state_dict()
    by_file: dict[str, list[tuple[str, str]]] = {}
    for local, hf_name in names.items():
        by_file.setdefault(files.weight_map[hf_name], []).append((local, hf_name))
    from safetensors import safe_open

    for file_name in sorted(by_file):  # first every shape, then any copy: a mismatch changes nothing
        path = directory / file_name
        if not path.exists():
            raise WeightsError(f"{origin}: shard {file_name} is missing (the index names it); download it again")
        wrong = []
        try:
            with safe_open(str(path), framework="pt") as f:
                present = set(f.keys())
                for local, hf_name in by_file[file_name]:
                    if hf_name not in present:
                        raise WeightsError(f"{origin}: shard {file_name} lacks {hf_name}, which the index puts there")
                    shape = tuple(f.get_slice(hf_name).get_shape())
                    if shape != tuple(state[local].shape):
                        wrong.append(f"{hf_name} is {shape}, the config makes it {tuple(state[local].shape)}")
        except WeightsError:
            raise
        except Exception as e:  # a damaged header
            raise WeightsError(f"{origin}: shard {file_name} is not a readable safetensors file ({e})") from None
        if wrong:
            raise WeightsError(f"{origin} has tensors of another shape: " + "; ".join(wrong[:6]))
    with torch.no_grad():
        for file_name, entries in sorted(by_file.items()):
            with safe_open(str(directory / file_name), framework="pt") as f:
                for local, hf_name in entries:
                    state[local].copy_(f.get_tensor(hf_name).to(state[local].dtype))
    logger.info(f"stage {stage}: {len(names)} tensors from {origin} ({len(by_file)} file(s))")


def _check_unexpected(files: CheckpointFiles, config: Config, stage: int, origin: str) -> None:
    """Names the checkpoint holds that no stage of this model has (biases, extra layers): they would be lost."""
    m = config.model
    known = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    layer_names = set(build_layer_names(m))
    unexpected = []
    for name in files.weight_map:
        if name in known or _IGNORED.search(name):
            continue
        match = _HF_LAYER.match(name)
        if match and int(match.group(1)) < m.n_layers and match.group(2) in layer_names:
            continue
        unexpected.append(name)
    if unexpected:
        raise WeightsError(
            f"{origin} holds tensors this model has no place for: {', '.join(sorted(unexpected)[:6])}"
            + (" ..." if len(unexpected) > 6 else "")
            + " (another architecture, or more layers than model.n_layers)"
        )


def build_layer_names(m: ModelConfig) -> list[str]:
    """The names of one decoder layer's tensors, relative to the layer."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with torch.device("meta"):
        layer = LlamaDecoderLayer(llama_config(m), layer_idx=0)
    return list(layer.state_dict())


# --- out


def export_checkpoint(
    config: Config, stages: Mapping[int, Mapping[str, torch.Tensor]], out: str | Path, tokenizer=None
) -> Path:
    """Writes the stages' parameters as one Hugging Face Llama checkpoint (config.json, safetensors shards and
    their index, the tokenizer) into ``out``, which must not exist or be empty. Written in a temporary folder
    beside it and renamed at the end: a failure leaves nothing behind."""
    from safetensors.torch import save_file

    out = Path(out).expanduser()
    n = config.pipeline.n_stages
    missing = [k for k in range(n) if k not in stages]
    if missing:
        raise WeightsError(f"stages {missing} are missing; every one of the {n} stages is needed for a checkpoint")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise WeightsError(f"--out {out} exists and is not an empty folder; choose a new folder")
    tensors: dict[str, torch.Tensor] = {}
    from sentinel_node.model.stage import build_stage

    for k in range(n):
        expected = build_stage(config.model, k, n, device="meta").state_dict()
        given = stages[k]
        if set(given) != set(expected):
            diff = sorted(set(expected) ^ set(given))
            raise WeightsError(f"stage {k}'s state does not fit the config (names differ: {', '.join(diff[:5])})")
        for local, hf_name in stage_hf_names(config.model, k, n, list(expected)).items():
            value = given[local]
            if tuple(value.shape) != tuple(expected[local].shape):
                raise WeightsError(
                    f"stage {k}: {local} is {tuple(value.shape)}, the config makes it {tuple(expected[local].shape)}"
                )
            tensors[hf_name] = value.detach().to("cpu").contiguous()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        hf_config = llama_config(config.model)
        hf_config.tie_word_embeddings = False
        hf_config.architectures = ["LlamaForCausalLM"]
        if tokenizer is not None and tokenizer.hf is not None:
            hf_config.eos_token_id = tokenizer.eos[0]
        hf_config.save_pretrained(str(staging))
        shards, current, size = [], {}, 0
        for name in sorted(tensors, key=_export_order):
            nbytes = tensors[name].numel() * tensors[name].element_size()
            if current and size + nbytes > SHARD_BYTES:
                shards.append(current)
                current, size = {}, 0
            current[name] = tensors[name]
            size += nbytes
        shards.append(current)
        if len(shards) == 1:
            save_file(shards[0], str(staging / SINGLE_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(staging / file_name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, file_name))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (staging / INDEX_FILE).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        if tokenizer is not None:
            tokenizer.save(staging)
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(f"exported {len(tensors)} tensors of {n} stages to {out}")
    return out


def _export_order(name: str) -> tuple[int, str]:
    match = _HF_LAYER.match(name)
    if name == "model.embed_tokens.weight":
        return (-1, name)
    return (int(match.group(1)), name) if match else (1 << 30, name)
