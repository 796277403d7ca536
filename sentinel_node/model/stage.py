"""Stage k of n of a Llama-style decoder, built from transformers' Llama blocks.

Stage 0 owns the token embedding, the last stage the final norm, the LM head and the loss. Parameters are
initialized from the swarm seed and the global layer index, so every replica of a stage starts identical and the
stages together equal the unsplit model.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from sentinel_node.config import ModelConfig
from sentinel_node.model.plan import layer_range


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers' rope_parameters for the config (plain RoPE, or a pretrained Llama's scaling)."""
    params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        params.update({k: v for k, v in cfg.rope_scaling.model_dump().items() if v is not None})
    return params


def llama_config(cfg: ModelConfig) -> LlamaConfig:
    """The transformers config of the whole (unsplit) model; embedding and head untied (see model/weights.py)."""
    llama = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope_parameters(cfg),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
    )
    llama._attn_implementation = "sdpa"
    return llama


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class StageModule(nn.Module):
    """forward: token ids (B, T) or hidden states (B, T, H) -> hidden states, or logits on the last stage."""

    def __init__(
        self, cfg: ModelConfig, stage: int, n_stages: int, seed: int = 0, device: str | None = None, init: bool = True
    ):
        super().__init__()
        self.stage, self.n_stages = stage, n_stages
        self.layer_indices = layer_range(cfg.n_layers, stage, n_stages)
        llama = llama_config(cfg)
        with torch.device(device or "cpu"):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
            self.layers = nn.ModuleList(LlamaDecoderLayer(llama, layer_idx=i) for i in self.layer_indices)
            self.rotary = LlamaRotaryEmbedding(llama)
            self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps) if self.is_last else None
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if self.is_last else None
        if init and str(device) != "meta":  # meta: shapes only; init=False: weights are loaded next
            self._initialize(seed, cfg.init_std)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    @torch.no_grad()
    def _initialize(self, seed: int, std: float) -> None:
        named = dict(self.named_parameters())
        for local, global_idx in enumerate(self.layer_indices):
            prefix = f"layers.{local}."
            for name, param in named.items():
                if name.startswith(prefix):
                    self._init_param(param, _generator(seed, f"layer{global_idx}.{name[len(prefix) :]}"), std)
        for name in ("embed.weight", "head.weight", "norm.weight"):
            if name in named:
                self._init_param(named[name], _generator(seed, name), std)

    @staticmethod
    def _init_param(param: torch.Tensor, generator: torch.Generator, std: float) -> None:
        if param.dim() == 1:
            param.fill_(1.0)  # RMSNorm gains
        else:
            param.copy_(torch.randn(param.shape, generator=generator) * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.is_first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.rotary(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, position_ids=positions, position_embeddings=position_embeddings)
        if self.is_last:
            return self.head(self.norm(hidden))
        return hidden

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_stage(
    cfg: ModelConfig, stage: int, n_stages: int, seed: int = 0, device: str | None = None, init: bool = True
) -> StageModule:
    return StageModule(cfg, stage, n_stages, seed, device, init)
