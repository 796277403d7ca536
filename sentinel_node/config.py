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
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent / "configs" / "tiny.yaml"


class ConfigError(ValueError):
    """A config file or value is invalid; the message names the field and what to do."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class RopeScaling(_Strict):
    """Rotary-embedding scaling of a pretrained Llama (Llama 3.1+ use ``llama3``); None: plain RoPE."""

    rope_type: Literal["llama3", "linear"] = "llama3"
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float | None = Field(1.0, gt=0, description="llama3 only")
    high_freq_factor: float | None = Field(4.0, gt=0, description="llama3 only")
    original_max_position_embeddings: int | None = Field(8192, ge=1, description="llama3 only")


# Model fields added after swarms were already running: they enter the swarm hash only when they differ from their
# defaults, so every existing config (tiny.yaml, demo.yaml) keeps its hash and its checkpoints stay loadable.
_LATER_MODEL_FIELDS = {"max_position_embeddings": 4096, "rope_scaling": None}


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
    max_position_embeddings: int = Field(4096, ge=2, description="the longest context the exported model claims")
    rope_scaling: RopeScaling | None = None
    init_from: str | None = Field(
        None,
        description="a Hugging Face Llama checkpoint (a local folder or a hub id) whose weights each stage starts "
        "from; not in the swarm hash (each machine may keep its copy elsewhere), names and shapes are checked",
    )

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
        "auto", description="auto: bf16 autocast on GPUs that support it, else fp32 (wire_dtype is separate)"
    )
    wire_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="dtype of activations and gradients between stages (every node must agree: it is in the config "
        "hash); float32 for CPU swarms, bfloat16 for swarms whose stages run on GPUs (docs/decisions.md)",
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
    "opposed": 0.015,
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
    "opposed": "linear",
}


AUDIT_FIELDS = frozenset(
    {
        "audit_rate",
        "probation_audit_rate",
        "suspect_audit_rate",
        "suspect_evidence",
        "loss_evidence",
        "loss_kappa",
        "loss_limit",
        "audit_tolerance",
        "audit_drift_factor",
        "audit_exact",
        "audit_timeout",
        "audit_queue",
        "audit_cache_mib",
        "audit_refusal_limit",
    }
)

# the trainer's loss gate (sentinel_node/verification/excess.py): not a boundary monitor's settings either
LOSS_GATE_FIELDS = frozenset({"loss_gate", "loss_gate_agree", "loss_gate_warmup"})


class VerificationConfig(_Strict):
    """SENTINEL's knobs (docs/architecture.md section 3); defaults are the paper's where it gives one."""

    beta_act: float = Field(0.9, gt=0, lt=1, description="EMA decay of activation baselines")
    beta_grad: float = Field(0.8, gt=0, lt=1, description="EMA decay of gradient baselines")
    n_projections: int = Field(16, ge=1, description="random directions for the sliced Wasserstein distance")
    n_quantiles: int = Field(33, ge=3, description="quantile levels per projection")
    spectral_rank: int = Field(4, ge=1, description="singular values counted as the tensor's dominant energy")
    spectral_oversample: int = Field(
        8, ge=0, description="extra test vectors of the randomized range finder behind the spectral share"
    )
    spectral_power_iterations: int = Field(
        1, ge=0, le=4, description="power iterations of that range finder (each reads the tensor twice more)"
    )
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
    opposed_from_boundary: int = Field(
        1,
        ge=0,
        description="first boundary whose activations are judged by the share of rows opposed to their mean: the "
        "first stage's output, close to the embedding table, holds honest rows that point many ways",
    )
    warmup: int = Field(150, ge=1, description="accepted tensors per boundary before a moderate crossing is flagged")
    warmup_fenced_after: int = Field(
        32,
        ge=0,
        # the name of this setting until 2026-12-04, when only blatant crossings were flagged in warm-up
        validation_alias=AliasChoices("warmup_fenced_after", "warmup_blatant_after"),
        description="scores a metric's fence must hold (at most `window`) before a crossing of it is flagged in "
        "warm-up, where a majority of senders is the reference (0: never)",
    )
    strike_limit: int = Field(3, ge=1, description="S: strikes at which a sender is banned")
    forgive_after: int = Field(100, ge=1, description="F: clean checks that forgive one strike")
    forgive_steps: int = Field(
        50, ge=0, description="global steps without a flag that forgive one strike too (0: clean checks alone)"
    )
    repeat_within: int = Field(
        4,
        ge=0,
        description="a fence crossing (not blatant) of a sender with peers strikes only if the sender's previous flag "
        "came within this many of its checks; an isolated one is a suspicion, audited (0: every crossing strikes)",
    )
    blatant_severity: float = Field(
        4.0, gt=1, description="a flag this far over its threshold (severity: 1 at the threshold) weighs two strikes"
    )
    blatant_limit: int = Field(3, ge=1, description="blatant flags, forgiven one per blatant_forgive_after, that ban")
    blatant_forgive_after: int = Field(1000, ge=1, description="clean checks that forgive one blatant flag")
    probation: int = Field(
        100, ge=0, description="clean checks a sender new to a running swarm passes on probation (0: no probation)"
    )
    reference_pool: int = Field(
        12, ge=1, description="recent profiles, an equal share per sender, whose median is the reference"
    )
    reference_horizon: int = Field(256, ge=1, description="checks after which a silent sender leaves the reference")
    peer_pool: int = Field(64, ge=0, description="recent checks of a boundary a sender is ranked against (0: off)")
    peer_kappa: float = Field(1.0, ge=0, description="normal score by which a sender may outrank its peers per check")
    peer_limit: float = Field(10.0, ge=0, description="accumulated excess at which the peer test flags (0: off)")
    replay_keep: int = Field(256, ge=0, description="recent tensors per boundary kept as sketches (0: no check)")
    replay_width: int = Field(32, ge=1, description="random directions per sequence in a replay sketch")
    replay_similarity: float = Field(
        0.95, gt=0, le=1, description="cosine every sequence of a tensor must reach in a stored one: a near-copy"
    )
    max_senders: int = Field(64, ge=1, description="senders a verifier keeps state for; the oldest is forgotten")
    passage_floor: float = Field(
        0.8,
        ge=0,
        le=2,
        description="1 - cosine of a middle stage's input gradient and the output gradient it was given above which "
        "it is flagged whatever the window says (sentinel_node/verification/passage.py; 0: not judged). A flag "
        "drops the gradient and has the crossing audited; it is never a strike (needs audits on)",
    )
    passage_rows: int = Field(
        256,
        ge=0,
        le=65536,
        description="rows (token positions) of the output gradient a verifier asks the next one for, drawn at random "
        "each microbatch, to judge the passage on (0: all of them)",
    )
    coherence_kappa: float = Field(
        1.0,
        ge=0,
        description="IQRs of the boundary's log coherence by which a middle stage's contribution to a gradient may "
        "share one direction across tokens per check before it counts as evidence (verification/coherence.py)",
    )
    coherence_limit: float = Field(
        4.0,
        ge=0,
        description="the coherence evidence at which a sender is flagged and struck (0: off; needs the passage)",
    )
    drift_kappa: float = Field(
        1.0,
        ge=0,
        description="IQRs of the boundary's scores by which a sender's mean activation row may depart from its "
        "peers' per check before it counts as evidence (verification/drift.py)",
    )
    drift_limit: float = Field(
        4.0,
        ge=0,
        description="the drift evidence at which a sender of activations is flagged and struck (0: off; needs five "
        "senders at the boundary)",
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
    probation_audit_rate: float = Field(
        0.25, ge=0, le=1, description="the audit rate of a stage replica on probation (a new identity)"
    )
    suspect_audit_rate: float = Field(
        1.0,
        ge=0,
        le=1,
        description="the audit rate of a stage replica holding a strike or a blatant mark not yet forgiven",
    )
    suspect_evidence: float = Field(
        0.5,
        ge=0,
        le=1,
        description="share of peer_limit that a sender's evidence in the peer test reaches to make it a suspect "
        "before any strike (0: only strikes do)",
    )
    loss_evidence: float = Field(
        0.5,
        ge=0,
        le=1,
        description="share of loss_limit that a stage replica's evidence of higher losses than its peers' (the "
        "microbatches it computed, ranked) reaches to make it a suspect; never a strike (0: off)",
    )
    loss_kappa: float = Field(
        0.25,
        ge=0,
        description="normal score by which a replica's excess loss may outrank its peers' per microbatch before it "
        "counts as evidence (the loss evidence's own kappa: a suspicion costs audits, never a strike)",
    )
    loss_limit: float = Field(
        10.0, ge=0, description="the loss evidence's limit: a replica is a suspect at loss_evidence times it"
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
    # the trainer's loss gate (sentinel_node/verification/excess.py; docs/decisions.md, "The loss gate")
    loss_gate: float = Field(
        6.0,
        ge=0,
        description="robust deviations by which a microbatch's loss may exceed what its text predicts before its "
        "update is held back and it is sent again on other replicas (0: off)",
    )
    loss_gate_agree: float = Field(
        0.05, ge=0, description="log-loss margin within which a third attempt does no worse than the held ones"
    )
    loss_gate_warmup: int = Field(
        64, ge=8, description="applied microbatches the trainer fits its loss prediction on before it gates"
    )

    def monitor_settings(self, direction: Literal["activation", "gradient"], seed: int, boundary: int | None = None):
        """Plain settings for one boundary monitor (the verification core does not import pydantic). The rows'
        shared direction (`opposed`) judges activations from `opposed_from_boundary` on (None: any boundary)."""
        from sentinel_node.verification import MonitorSettings
        from sentinel_node.verification.metrics import ACTIVATION_ONLY, METRICS

        values = self.model_dump(
            exclude={"beta_act", "beta_grad", "floors", "fence_spaces", "replacement", "gradient_replacement"}
            | {"opposed_from_boundary"}  # it decides `metrics` below
            | {"passage_rows"}  # what a verifier asks for; the monitor judges the rows it is given
            | AUDIT_FIELDS
            | LOSS_GATE_FIELDS
        )
        values["fence_spaces"] = {**DEFAULT_FENCE_SPACES, **self.fence_spaces}
        values["replacement"] = self.replacement if direction == "activation" else self.gradient_replacement
        values["floors"] = {**DEFAULT_FLOORS, **self.floors}
        beta = self.beta_act if direction == "activation" else self.beta_grad
        shared = direction == "activation" and (boundary is None or boundary >= self.opposed_from_boundary)
        unjudged = () if shared else ACTIVATION_ONLY
        if direction == "gradient":  # a gradient's mean row is the coherence test's, on what the stage added
            values["drift_limit"] = 0.0
        metrics = tuple(name for name in METRICS if name not in unjudged)
        return MonitorSettings(beta=beta, seed=seed, metrics=metrics, **values)

    def gate_settings(self):
        """The loss gate's settings as the verification core takes them."""
        from sentinel_node.verification.excess import GateSettings

        return GateSettings(k=self.loss_gate, agree=self.loss_gate_agree, warmup=self.loss_gate_warmup)

    def audit_tolerances(self):
        """The audit tolerances as the verification core takes them."""
        from sentinel_node.verification.audit import AuditTolerance

        return AuditTolerance(exact=self.audit_exact, floor=self.audit_tolerance, factor=self.audit_drift_factor)


class SwarmConfig(_Strict):
    """The DHT society: who holds which role, how long records live (docs/security.md).

    Trainers and verifiers are admitted by the swarm's trust roots: listed here (``trainers``,
    ``trusted_verifiers``), or holding a role certificate signed by ``organiser`` (``sentinel-node admit``). Stages
    are open to any volunteer. ``open_trainers``/``open_verifiers`` admit anyone to those roles: an explicit opt-in
    that an attacker with many keys can abuse (docs/security.md says how).
    """

    prefix: str = Field("sentinel-tiny", min_length=1, pattern=r"^[A-Za-z0-9_-]+$")
    seed: int = Field(0, description="seeds the shared random projections and the model's initialization")
    organiser: str | None = Field(
        None, description="the organiser's RSA public key ('ssh-rsa AAAA...'): it signs role certificates"
    )
    trainers: list[str] = Field(default_factory=list, description="peer ids (or public keys) of admitted trainers")
    trusted_verifiers: list[str] = Field(default_factory=list, description="public keys or peer ids")
    open_trainers: bool = Field(False, description="anyone may be a trainer (and pace every replica's steps)")
    open_verifiers: bool = Field(False, description="anyone may verify; bans count after min_voter_age")
    ban_quorum: int = Field(2, ge=1)
    min_voter_age: float = Field(
        120.0, ge=0, description="open verifier set: seconds a reader must have seen a verifier before its bans count"
    )
    strike_ttl: float = Field(86400.0, gt=0, description="seconds a strike record (and an exclusion) lives")
    announce_period: float = Field(5.0, gt=0, description="seconds between announcement refreshes")
    announce_ttl: float = Field(20.0, gt=0, description="seconds an announcement lives unless refreshed")
    request_timeout: float = Field(5.0, gt=0, description="seconds a DHT read may take")
    rebalance_period: float = Field(
        60.0, ge=0, description="mean seconds between a placed replica's checks for a better stage (0: never)"
    )
    balance_quality: float = Field(
        0.75,
        ge=0,
        le=1,
        description="a replica moves when the slowest stage's total is below this share of what the move makes it",
    )

    @model_validator(mode="after")
    def _trust(self) -> SwarmConfig:
        self.trust_roots()  # entries that name no peer are errors here, not at join
        self.exclusion_params()  # the exclusion policy's own rule decides what a valid quorum is
        return self

    def unadmittable_roles(self) -> list[str]:
        """The roles this config admits nobody to (no listed peer, no organiser, not open): a swarm that needs
        them cannot run, and its nodes say so when they start."""
        return [
            role
            for role, listed, open_ in (
                ("trainer", self.trainers, self.open_trainers),
                ("verifier", self.trusted_verifiers, self.open_verifiers),
            )
            if not (listed or self.organiser or open_)
        ]

    def organiser_key(self) -> bytes | None:
        """The organiser's public key, checked; ValueError saying what is wrong with it."""
        if self.organiser is None:
            return None
        from dht import IdentityError, peer_id_from_public_key  # hivemind: not at the top (--help stays fast)

        key = self.organiser.strip().encode()
        try:
            peer_id_from_public_key(key)
        except IdentityError as e:
            raise ValueError(
                f"organiser {self.organiser[:40]!r}... is not an OpenSSH RSA public key ({e}); paste the line "
                "`sentinel-node admit --new-organiser-key FILE` printed"
            ) from None
        return key

    def trust_roots(self):
        """The swarm's :class:`dht.TrustRoots`; ValueError naming an entry that names no peer."""
        from dht import TrustRoots, peer_id_from_entry

        return TrustRoots(
            organiser=self.organiser_key(),
            trainers=frozenset(peer_id_from_entry(e, f"trainers entry {i}") for i, e in enumerate(self.trainers)),
            verifiers=frozenset(
                peer_id_from_entry(e, f"trusted_verifiers entry {i}") for i, e in enumerate(self.trusted_verifiers)
            ),
            open_trainers=self.open_trainers,
            open_verifiers=self.open_verifiers,
        )

    def exclusion_params(self):
        """Who may vote and how many votes exclude (:class:`peers.ExclusionParams`); ValueError naming the entry
        or the number that is wrong."""
        from peers import ExclusionParams  # here, not at the top: peers imports hivemind, and --help must stay fast

        return ExclusionParams(
            tuple(self.trusted_verifiers),
            self.ban_quorum,
            open_verifiers=self.open_verifiers,
            organiser=self.organiser,
            prefix=self.prefix,
            min_voter_age=self.min_voter_age,
        )

    def exclusion_policy(self):
        """The swarm's :class:`peers.ExclusionPolicy`."""
        from peers import ExclusionPolicy

        return ExclusionPolicy(self.exclusion_params())


class DataConfig(_Strict):
    """What the trainer feeds the swarm. Two modes (sentinel_node/data):

    - bytes (``tokenizer: bytes`` and no ``dataset``): ``path`` is a directory of text files, or None for the
      embedded corpus, read whole into memory as bytes (vocabulary 256), as the tiny default always has been;
    - streamed (a real ``tokenizer``, or a ``dataset``): documents from ``path`` (a folder or file of .txt, .jsonl
      or .parquet) or the hub ``dataset`` are tokenized on the fly, packed into ``seq_len + 1``-token blocks with
      the end-of-text token between documents, and shuffled through a buffer; memory stays bounded.
    """

    path: str | None = Field(
        None, description="bytes: a directory of text files (None: the embedded corpus); streamed: a folder or file"
    )
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="bytes: share of files held out for validation")
    max_bytes: int = Field(16 * 2**20, ge=2**16, description="bytes: bytes read from the corpus")
    tokenizer: str = Field("bytes", min_length=1, description="bytes, a tokenizer folder, or a hub id")
    dataset: str | None = Field(None, min_length=1, description="a Hugging Face hub dataset id, streamed")
    dataset_config: str | None = Field(None, description="the hub dataset's configuration (subset) name")
    split: str = Field("train", min_length=1, description="the hub dataset's training split")
    val_split: str | None = Field(
        None, description="a held-out split to validate on; None: the first val_sequences blocks are held out"
    )
    text_column: str = Field("text", min_length=1, description="the column holding the text (.jsonl, .parquet, hub)")
    val_sequences: int = Field(64, ge=1, description="streamed: sequences held out (or read from val_split)")
    shuffle_buffer: int = Field(1024, ge=1, description="streamed: packed sequences in the shuffle buffer")

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.path is not None and self.dataset is not None:
            raise ValueError("give data.path (local files) or data.dataset (a hub id), not both")
        return self

    @property
    def streamed(self) -> bool:
        """Whether the trainer streams tokenized documents (else: the byte corpus, held in memory)."""
        return self.tokenizer != "bytes" or self.dataset is not None


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
    rejoin: bool = Field(False, description="a banned attacker comes back at once under a fresh identity (Sybil)")
    silent_verifiers: int = Field(0, ge=0, description="verifiers per boundary that relay without checking")
    eval_every: int = Field(10, ge=1)
    eval_batches: int = Field(4, ge=1)


class Config(_Strict):
    model: ModelConfig = ModelConfig()
    pipeline: PipelineConfig = PipelineConfig()
    verification: VerificationConfig = VerificationConfig()
    # by default nobody may train or verify: who may is every swarm's own explicit choice (docs/security.md)
    swarm: SwarmConfig = SwarmConfig()
    data: DataConfig = DataConfig()
    sim: SimConfig = SimConfig()

    @model_validator(mode="after")
    def _someone_checks(self) -> Config:
        if self.sim.silent_verifiers >= self.sim.verifiers_per_boundary:
            raise ValueError(
                f"sim.silent_verifiers={self.sim.silent_verifiers} leaves none of the "
                f"{self.sim.verifiers_per_boundary} verifiers per boundary checking; raise sim.verifiers_per_boundary"
            )
        return self

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
        shared["model"].pop("init_from", None)  # where the weights lie on each machine; names and shapes are checked
        for name, default in _LATER_MODEL_FIELDS.items():
            if shared["model"].get(name) == default:
                shared["model"].pop(name)
        blob = json.dumps(shared, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def swarm_rules(self):
        """The rules every validator and reader of this swarm applies (:class:`dht.SwarmRules`)."""
        from dht import SwarmRules

        swarm = self.swarm
        return SwarmRules(
            prefix=swarm.prefix,
            config_hash=self.swarm_hash(),
            n_stages=self.pipeline.n_stages,
            trust=swarm.trust_roots(),
            announce_ttl=swarm.announce_ttl,
            strike_ttl=swarm.strike_ttl,
        )

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
