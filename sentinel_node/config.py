"""Every configurable value of a swarm, with its default, in one place.

A swarm config is a YAML file (``configs/tiny.yaml``) read into :class:`SwarmConfig`. Unknown or mistyped keys are
rejected with the offending field named, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent / "configs" / "tiny.yaml"


class ConfigError(ValueError):
    """A config file or value is invalid; the message names the field and what to do."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(_Strict):
    """A Llama-style decoder; the tiny default trains on a CPU in minutes."""

    vocab_size: int = Field(256, ge=2, description="bytes: 256")
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(344, ge=8)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(4, ge=1)
    n_kv_heads: int = Field(4, ge=1)
    rope_theta: float = Field(10000.0, gt=0)
    rms_norm_eps: float = Field(1e-5, gt=0)
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.n_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        return self


class PipelineConfig(_Strict):
    """How the model is cut into stages and how each global step is made of microbatches."""

    n_stages: int = Field(4, ge=2)
    microbatch_size: int = Field(8, ge=1, description="sequences per microbatch")
    seq_len: int = Field(64, ge=2, description="tokens per sequence")
    microbatches_per_step: int = Field(4, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    warmup_steps: int = Field(20, ge=0, description="linear learning-rate warm-up, in global steps")
    average_every: int = Field(5, ge=1, description="replicas of a stage average parameters every this many steps")
    compression: Literal["none", "float16", "blockwise_8bit"] = "none"
    max_tensor_mib: float = Field(64.0, gt=0, description="largest tensor a node accepts from the network")
    mixed_precision: Literal["auto", "bf16", "off"] = Field(
        "auto", description="auto: bf16 autocast on GPUs that support it, else fp32; tensors on the wire stay fp32"
    )


# below these, a distance is noise whatever the window says (a sign-flip share of 0.1, a 10% change of norm)
DEFAULT_FLOORS = {
    "l1": 0.05,
    "l2": 0.05,
    "norm": 0.1,
    "scale": 0.05,
    "sign_flip": 0.25,
    "wasserstein": 0.05,
    "spectral": 0.05,
}


# heavy-tailed distances get a fence in log space; shares in [0, 1] whose honest median is ~0 get a linear one
DEFAULT_FENCE_SPACES = {
    "l1": "relative_log",
    "l2": "relative_log",
    "norm": "relative_log",
    "scale": "relative_log",
    "sign_flip": "linear",
    "wasserstein": "relative_log",
    "spectral": "linear",
}


AUDIT_FIELDS = frozenset(
    {
        "audit_rate",
        "audit_tolerance",
        "audit_drift_factor",
        "audit_exact",
        "audit_timeout",
        "audit_queue",
        "audit_cache_mib",
        "audit_refusal_limit",
    }
)


class VerificationConfig(_Strict):
    """SENTINEL's knobs (docs/architecture.md section 3); defaults are the paper's where it gives one."""

    beta_act: float = Field(0.9, gt=0, lt=1, description="EMA decay of activation baselines")
    beta_grad: float = Field(0.8, gt=0, lt=1, description="EMA decay of gradient baselines")
    n_projections: int = Field(16, ge=1, description="random directions for the sliced Wasserstein distance")
    n_quantiles: int = Field(33, ge=3, description="quantile levels per projection")
    spectral_rank: int = Field(4, ge=1, description="singular values counted as the tensor's dominant energy")
    window: int = Field(128, ge=8, description="accepted scores kept per metric for the adaptive threshold")
    fence_k: float = Field(5.5, gt=0, description="threshold = Q3 + k * IQR")
    fence_spaces: dict[str, Literal["relative_log", "linear"]] = Field(
        default_factory=lambda: dict(DEFAULT_FENCE_SPACES),
        description="per metric: fence on log(1 + score / median) for heavy-tailed distances, raw for bounded ones",
    )
    floors: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_FLOORS),
        description="smallest threshold per metric, so a flat window cannot flag noise",
    )
    row_clip: float = Field(4.0, gt=1, description="rows (tokens) are clipped to this many times the median row norm")
    warmup: int = Field(150, ge=1, description="accepted tensors per boundary before anything can be flagged")
    strike_limit: int = Field(3, ge=1, description="S: strikes at which a sender is banned")
    forgive_after: int = Field(100, ge=1, description="F: clean checks that forgive one strike")
    drift_window: int = Field(32, ge=0, description="checks per sender in the persistent-drift test (0 disables it)")
    drift_limit: float = Field(
        0.5, gt=0, description="mean log-excess over the median that a sender may sustain over the drift window"
    )
    shift_window: int = Field(
        64, ge=0, description="checks per boundary in which a shift of most senders together strikes no one (0: off)"
    )
    replacement: Literal["ema", "zero", "drop"] = Field(
        "drop", description="what replaces a flagged activation (downstream replicas trained on EMA noise drift)"
    )
    gradient_replacement: Literal["ema", "zero", "drop"] = Field(
        "drop", description="what replaces a flagged gradient (noise fed to Adam moves weights as far as a real one)"
    )
    # recomputation audits (sentinel_node/verification/audit.py; docs/decisions.md, "Recomputation audits")
    audit_rate: float = Field(
        0.02, ge=0, le=1, description="share of settled microbatches whose work a verifier has recomputed, per stage"
    )
    audit_tolerance: float = Field(
        0.5, gt=0, description="relative error a claim may always show (of a middle stage's contribution)"
    )
    audit_drift_factor: float = Field(
        4.0, gt=0, description="a claim may drift this many times the auditor's own drift per step, per step"
    )
    audit_exact: float = Field(1e-5, gt=0, description="relative error at or below which two results are the same")
    audit_timeout: float = Field(30.0, gt=0, description="seconds an audit may take before it is dropped")
    audit_queue: int = Field(8, ge=1, description="audits a verifier holds at once; further draws are dropped")
    audit_cache_mib: float = Field(64.0, gt=0, description="MiB of relayed tensors a verifier keeps for audits")
    audit_refusal_limit: int = Field(3, ge=1, description="audit requests an auditor refuses in a row for a strike")

    def monitor_settings(self, direction: Literal["activation", "gradient"], seed: int):
        """Plain settings for one boundary monitor (the verification core does not import pydantic)."""
        from sentinel_node.verification import MonitorSettings

        values = self.model_dump(
            exclude={"beta_act", "beta_grad", "floors", "fence_spaces", "replacement", "gradient_replacement"}
            | AUDIT_FIELDS
        )
        values["fence_spaces"] = {**DEFAULT_FENCE_SPACES, **self.fence_spaces}
        values["replacement"] = self.replacement if direction == "activation" else self.gradient_replacement
        values["floors"] = {**DEFAULT_FLOORS, **self.floors}
        beta = self.beta_act if direction == "activation" else self.beta_grad
        return MonitorSettings(beta=beta, seed=seed, **values)

    def audit_tolerances(self):
        """The audit tolerances as the verification core takes them."""
        from sentinel_node.verification.audit import AuditTolerance

        return AuditTolerance(exact=self.audit_exact, floor=self.audit_tolerance, factor=self.audit_drift_factor)


class SwarmConfig(_Strict):
    """The DHT society: who is trusted, how long records live."""

    prefix: str = Field("sentinel-tiny", min_length=1, pattern=r"^[A-Za-z0-9_-]+$")
    seed: int = Field(0, description="seeds the shared random projections and the model's initialization")
    trusted_verifiers: list[str] = Field(default_factory=list, description="public keys or peer ids")
    ban_quorum: int = Field(2, ge=1)
    strike_ttl: float = Field(86400.0, gt=0, description="seconds a strike record (and an exclusion) lives")
    announce_period: float = Field(5.0, gt=0, description="seconds between announcement refreshes")
    announce_ttl: float = Field(20.0, gt=0, description="seconds an announcement lives unless refreshed")
    request_timeout: float = Field(5.0, gt=0, description="seconds a DHT read may take")

    @model_validator(mode="after")
    def _quorum(self) -> SwarmConfig:
        self.exclusion_params()  # the exclusion policy's own rule decides what a valid quorum is
        return self

    def exclusion_params(self):
        """Who may vote and how many votes exclude (:class:`peers.ExclusionParams`); ValueError naming the entry
        or the number that is wrong."""
        from peers import ExclusionParams  # here, not at the top: peers imports hivemind, and --help must stay fast

        return ExclusionParams(tuple(self.trusted_verifiers), self.ban_quorum)

    def exclusion_policy(self):
        """The swarm's :class:`peers.ExclusionPolicy`."""
        from peers import ExclusionPolicy

        return ExclusionPolicy(self.exclusion_params())


class DataConfig(_Strict):
    path: str | None = Field(None, description="a directory of text files; None: the embedded corpus")
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="share of files held out for validation")
    max_bytes: int = Field(16 * 2**20, ge=2**16, description="bytes read from the corpus")


class SimConfig(_Strict):
    """The in-process DP x PP mesh (sentinel_node/sim)."""

    replicas: int = Field(4, ge=1, description="data-parallel replicas per stage")
    malicious_fraction: float = Field(0.25, ge=0, lt=0.5, description="share of each stage's replicas that attack")
    attack_first_stage: bool = False
    attack_last_stage: bool = False
    steps: int = Field(150, ge=1)
    attack_start: int = Field(60, ge=0, description="global step at which attackers start")
    attack_probability: float = Field(1.0, gt=0, le=1)
    verifiers_per_boundary: int = Field(1, ge=1)
    eval_every: int = Field(10, ge=1)
    eval_batches: int = Field(4, ge=1)


class Config(_Strict):
    model: ModelConfig = ModelConfig()
    pipeline: PipelineConfig = PipelineConfig()
    verification: VerificationConfig = VerificationConfig()
    swarm: SwarmConfig = SwarmConfig()
    data: DataConfig = DataConfig()
    sim: SimConfig = SimConfig()

    @model_validator(mode="after")
    def _stages_have_layers(self) -> Config:
        if self.model.n_layers < self.pipeline.n_stages:
            raise ValueError(
                f"model.n_layers={self.model.n_layers} is fewer than pipeline.n_stages={self.pipeline.n_stages}: "
                "every stage needs at least one layer"
            )
        return self

    def swarm_hash(self) -> str:
        """A short digest of everything peers must agree on (not the simulator, data or per-node settings)."""
        shared = self.model_dump(include={"model", "pipeline", "verification", "swarm"})
        shared["pipeline"].pop("mixed_precision", None)  # each node picks what its own GPU supports
        blob = json.dumps(shared, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def with_overrides(self, **sections: dict) -> Config:
        """A copy with some fields of some sections replaced, validated like a file."""
        data = self.model_dump()
        for section, values in sections.items():
            data[section].update(values)
        return parse_config(data, source="overrides")


def parse_config(data: dict, source: str = "config") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            if err["type"] == "extra_forbidden":
                problems.append(f"{where}: unknown key (check its spelling against configs/tiny.yaml)")
            else:
                problems.append(f"{where}: {err['msg']}")
        raise ConfigError(f"invalid {source}:\n  " + "\n  ".join(problems)) from None


def load_config(path: str | Path | None = None) -> Config:
    """Reads a YAML config; None reads the tiny default."""
    path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(
            f"cannot read config {path}: {e.strerror}; pass --config with an existing YAML file"
        ) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config {path} must be a mapping of sections (model, pipeline, ...), not {type(data).__name__}"
        )
    return parse_config(data, source=f"config {path}")
