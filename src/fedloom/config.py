"""The typed experiment schema: YAML in, validated dataclasses out.

A config is a tree of dataclasses. Loading checks every field: an unknown key,
a wrong type or an out-of-range value raises :class:`ConfigError` whose message
is one line naming the dotted field (``client.lr: must be > 0, got -1``).
Overrides use the same dotted names (``fedloom run cfg.yaml client.lr=0.05``);
their values are parsed as YAML scalars/lists.

YAML is read with bounds (:func:`yaml_load`, :func:`safe_load_bounded`): aliases
may add at most :data:`MAX_ALIAS_NODES` nodes to a document (an alias bomb of
nine anchors of nine aliases, 9**9 leaves, is refused in 26 ms; unbounded it
hung ``fedloom run`` for over a minute), no alias may refer to its own anchor,
and nesting stops at :data:`MAX_DEPTH` levels (PyYAML raised RecursionError past
~490, at Python's default recursion limit). A config file with no settings
(empty, only comments, ``null``) is refused. An integer literal longer than
Python's int-parsing limit (``sys.get_int_max_str_digits()``, 4300 digits) is
refused naming the source and line (int() raised a ValueError that named neither).

Counts are bounded: every integer field but ``seed`` (rounds, clients, samples,
batch sizes, local steps and epochs, eval and checkpoint intervals, widths) is at
most :data:`MAX_COUNT` = 10**9, stated as ``maximum`` in ``fedloom schema``
(``rounds=10**12`` and ``2**63`` were accepted and ran). ``seed`` is an identifier,
hashed into every random stream (:mod:`fedloom.rng`), and has no bound.

Config stays at the edge: the engine turns a validated :class:`Config` into
typed objects, and core code never sees dicts.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from fedloom import registry

__all__ = [
    "Config",
    "ConfigError",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
]


class ConfigError(ValueError):
    """A config problem; ``str(err)`` is one line naming the field."""


# The bound of every integer field but ``seed``. Each counts something that costs
# time or memory (rounds, clients, samples, steps, widths); a billion of any is past
# what a run can finish or hold (a round takes milliseconds at least: 10**9 rounds
# are weeks), so a larger value is a typo or a probe, refused before anything
# starts. And the product of any two bounded counts (rounds x cohort, steps x
# batch) is 10**18 < 2**63: below the int64 that numpy and torch count in, so no
# count derived from two of them wraps around.
MAX_COUNT = 10**9


def _rng(**bounds: float) -> dict[str, Any]:
    return {"bounds": bounds}


def _f(default: Any, **bounds: float) -> Any:
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=_rng(**bounds))
    return field(default=default, metadata=_rng(**bounds))


@dataclass
class SyntheticConfig:
    """Synthetic(α, β) of FedProx / q-FFL: α controls how much local models
    differ, β how much local feature distributions differ."""

    alpha: float = _f(1.0, ge=0)
    beta: float = _f(1.0, ge=0)
    dim: int = _f(60, ge=1)
    classes: int = _f(10, ge=2)


@dataclass
class ShakespeareConfig:
    window: int = _f(80, ge=1)          # characters of context (LEAF: 80)
    stride: int = _f(1, ge=1)           # a window every `stride` characters
    min_chars: int = _f(4000, ge=1)     # a role needs this many characters to be a client
    max_clients: int = _f(0, ge=0)      # 0 = every role that qualifies
    max_windows: int = _f(0, ge=0)      # per client; 0 = all


@dataclass
class PartitionConfig:
    # A partitioner: iid, contiguous, dirichlet, shards, natural, classes, sizes, mixed,
    # flwr:NAME (a flwr-datasets partitioner), a plug-in or module:attr (a plug-in takes
    # the keys below that its signature names). See fedloom.data.partition.
    name: str = "dirichlet"
    # dirichlet, classes (split dirichlet), sizes (then dirichlet): one α, or one per class
    alpha: float | list[float] = _f(0.5, gt=0)
    min_samples: int = _f(10, ge=1)
    shards_per_client: int = _f(2, ge=1)
    max_tries: int = _f(1000, ge=1)
    # dirichlet: how the minimum is met (see fedloom.data.partition.dirichlet)
    min_policy: Literal["resample", "move"] = "resample"
    balance: bool = False
    # classes: k classes per client, how they are assigned and split among holders
    k: int = _f(2, ge=1)
    assign: Literal["random", "round_robin"] = "random"
    split: Literal["even", "dirichlet"] = "even"
    # sizes: the client-size distribution (powerlaw: Pareto exponent; lognormal: sigma;
    # list: counts, one relative size per client)
    distribution: Literal["powerlaw", "lognormal", "list"] = "powerlaw"
    exponent: float = _f(1.5, gt=0)
    sigma: float = _f(1.0, ge=0)
    counts: list[float] = _f([], ge=0)
    # sizes: labels "iid" or "dirichlet"; mixed: the partitioner of the non-IID clients
    # ("" = the partitioner's default: sizes iid, mixed dirichlet)
    then: str = ""
    # mixed: the fraction of clients that are IID
    iid_fraction: float = _f(0.5, ge=0, le=1)
    # flwr:NAME: the flwr-datasets partitioner's own options (num_partitions,
    # partition_by and seed are fedloom's)
    options: dict[str, Any] = _f({})


@dataclass
class FeatureConfig:
    """Feature skew (fedloom.data.feature): a per-client transform of the inputs."""

    # none, noise (Gaussian of level scale·k/(N−1)), permute (scale: the fraction of
    # features), rotate (angles ~ U(−scale, scale) degrees)
    name: Literal["none", "noise", "permute", "rotate"] = "none"
    scale: float = _f(0.0, ge=0)


@dataclass
class DataConfig:
    name: str = "mnist"
    num_clients: int = _f(100, ge=1)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    feature: FeatureConfig = field(default_factory=FeatureConfig)
    test_fraction: float = _f(0.2, ge=0, lt=1)
    # Use only the first N training samples of the source (0 = all): small tests.
    max_samples: int = _f(0, ge=0)
    # "all" merges the source's own test set into the pool before partitioning
    # (CRAFT's code); the global test set is then the union of the client splits.
    pool: Literal["train", "all"] = "train"
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    shakespeare: ShakespeareConfig = field(default_factory=ShakespeareConfig)
    # Your own data (name: npz or csv): the file, the label and client columns (csv).
    path: str = ""
    label: str = "label"
    client: str = ""
    # csv: the feature columns (default: every column but the label and client ones).
    features: list[str] = _f([])
    # Standardise every feature with the mean/std of the clients' training parts.
    standardize: bool = False
    # Every client needs at least this many samples (checked for natural splits).
    min_samples: int = _f(1, ge=1)
    # Datasets read from disk (fedloom.data.disk): where they live ("" = $FEDLOOM_DATA,
    # else ~/.cache/fedloom/data), whether their class counts are checked against the
    # published sizes, CIFAR-100's label set, the fraction of FEMNIST writers kept (LEAF's
    # --sf), the image column of a Hugging Face dataset, and the side images are resized to
    # (image-folder, hf; 0 = as stored).
    root: str = ""
    verify: bool = True
    labels: Literal["fine", "coarse"] = "fine"
    writer_fraction: float = _f(1.0, gt=0, le=1)
    image_column: str = "image"
    image_size: int = _f(0, ge=0)
    # hf with data.client: writers with more samples than this are not eligible (0 = no bound)
    max_client_samples: int = _f(0, ge=0)
    # Training augmentation (fedloom.data.augment): "auto" = the source's standard one
    # (random crop with padding 4 and horizontal flip for CIFAR and Tiny-ImageNet; none
    # for the others), "standard" = the same, refused where a source has none.
    augment: Literal["auto", "none", "standard"] = "auto"


@dataclass
class ModelConfig:
    name: str = "mlp"
    hidden: list[int] = _f([200, 200], ge=1)   # mlp
    # mlp: "none" reproduces FLARE's activation-less "FC" model (a linear map)
    activation: Literal["relu", "none"] = "relu"
    channels: list[int] = _f([32, 64], ge=1)    # cnn: the two conv widths
    depth: int = _f(20, ge=8)                   # resnet: 6n + 2
    width: int = _f(16, ge=4)                   # resnet: channels of the first stage
    embed: int = _f(8, ge=1)                    # char_rnn: embedding width (LEAF: 8)
    cell: Literal["gru", "lstm"] = "gru"        # char_rnn: hidden sizes come from `hidden`
    # resnet: the normalisation layer (GroupNorm(1, C) as CRAFT's code; BatchNorm as
    # FLARE's and SA-PEF's code; none)
    norm: Literal["group", "batch", "none"] = "group"
    # What the server does with module buffers (BatchNorm statistics) after a round:
    # average (data-weighted), local (per client, FedBN), keep_global (never updated).
    # See fedloom.buffers.
    buffers: Literal["average", "local", "keep_global"] = "average"


@dataclass
class CohortConfig:
    size: int = _f(10, ge=1)


@dataclass
class ScheduleConfig:
    """Per-round client learning rate ``lr_t``.

    constant: ``lr``; exp: ``lr · gamma^t``; cosine: linear warm-up over
    ``warmup`` rounds, then cosine from ``lr`` to ``final_lr`` at the last round.
    """

    name: Literal["constant", "exp", "cosine"] = "constant"
    gamma: float = _f(0.999, gt=0, le=1)
    warmup: int = _f(0, ge=0)
    final_lr: float = _f(0.0, ge=0)


@dataclass
class ClientConfig:
    lr: float = _f(0.01, gt=0)
    momentum: float = _f(0.0, ge=0, lt=1)
    weight_decay: float = _f(0.0, ge=0)
    batch_size: int = _f(32, ge=1)
    epochs: int = _f(1, ge=1)
    # A fixed number of local steps; when set it replaces `epochs`.
    steps: int | None = _f(None, ge=1)
    prox_mu: float = _f(0.0, ge=0)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    # Local method: sgd (FedAvg/FedProx), scaffold, ditto; options go to its factory.
    method: str = "sgd"
    method_options: dict[str, Any] = _f({})
    # Mixed precision of the local forward/loss (fedloom.client.sgd.LocalSGD.amp): off by default.
    amp: Literal["none", "bf16", "fp16"] = "none"


@dataclass
class ServerConfig:
    """Server step ``w ← w − lr · opt(agg)`` (Reddi et al. 2021, FedOpt)."""

    # sgd, momentum, adam, yogi, adagrad, a plug-in or module:attr
    optimizer: str = "sgd"
    # "auto": the aggregator's public default step (its `default_server_lr`: 0.1 for
    # CRAFT, 1.0 for the FedAvg family); the number used is what the run directory's
    # config.yaml and summary.json record.
    lr: float | Literal["auto"] = _f("auto", gt=0)
    momentum: float = _f(0.9, ge=0, lt=1)
    beta1: float = _f(0.9, ge=0, lt=1)
    beta2: float = _f(0.99, ge=0, lt=1)
    eps: float = _f(1e-3, gt=0)
    # Screening of client updates before any aggregator (fedloom.engine.screen.screen_updates):
    # reject an update whose L2 norm exceeds `max_update_norm` (null = no bound) or
    # `max_norm_ratio` × the cohort's lower median norm (null = off), then clip each
    # accepted one to `clip_norm` (norm bounding, Sun et al. 2019; null = off).
    max_update_norm: float | None = _f(None, gt=0)
    max_norm_ratio: float | None = _f(1e4, gt=1)
    clip_norm: float | None = _f(None, gt=0)
    # The server sees only the sum of the masked updates (SecAgg+): refuses aggregators
    # and compressors a sum-only server cannot compute (fedloom.privacy).
    secure_aggregation: bool = False


@dataclass
class AggregatorConfig:
    name: str = "fedavg"
    options: dict[str, Any] = _f({})


@dataclass
class CompressionConfig:
    """Uplink compression and error feedback (:mod:`fedloom.compress`)."""

    name: str = "identity"
    options: dict[str, Any] = _f({})
    # Error feedback: none, ef, saef, sapef, ef21, cser, scafcom, flare, ec_prox, a
    # plug-in or module:attr. Its factory takes the keys below that its signature
    # names, then `feedback_options` (a plug-in's own options).
    feedback: str = "none"
    feedback_options: dict[str, Any] = _f({})
    alpha: float = _f(0.85, ge=0, le=1)          # SA-PEF step-ahead coefficient
    # constant, theory (α* from an online L̂), residual (min(alpha, κ·median ‖Δ‖/‖e‖))
    alpha_schedule: Literal["constant", "theory", "residual"] = "constant"
    alpha_kappa: float = _f(10.0, gt=0)           # κ of the residual schedule
    period: int = _f(5, ge=1)                     # CSER: reset every H rounds
    reset_ratio: float = _f(0.1, gt=0, le=1)      # CSER: top fraction of e sent at a reset
    beta: float = _f(0.2, gt=0, le=1)             # SCAFCOM momentum
    # EF21 under partial participation: step along the mean of all N clients' h_k
    # (EF21-PP, the published rule) or of the sampled clients' h_k only.
    ef21_mean: Literal["all", "sampled"] = "all"
    tau: float = _f(0.05, ge=0)                   # FLARE / EC+prox: τ_r = tau / tau_decay^(r+1)
    tau_decay: float = _f(1.1, gt=0)
    penalty_steps: int = _f(1, ge=0)              # FLARE: penalised local steps p
    penalty: Literal["l1", "l2"] = "l1"
    # FFL (Nori et al.): rate R_t = R (L_0/L_t)^(1/3) and local epochs
    # E_t = max(1, round(E (L_t/L_0)^(1/3))) from the global test loss L_t.
    # A round planner (fedloom.hooks): none, ffl, a plug-in or module:attr.
    adaptive: str = "none"
    adaptive_options: dict[str, Any] = _f({})


@dataclass
class MetricsConfig:
    # SA-PEF's gradient mismatch ‖∇f(w) − ∇f(w − α_p e_k)‖² (costs two gradients a client).
    mismatch: bool = False
    mismatch_alpha: float = _f(1.0, ge=0, le=1)
    # Client metrics (fedloom.hooks) besides the boolean keys above: registered names,
    # plug-ins or module:attr; `options` maps a name to its factory's options.
    hooks: list[str] = _f([])
    options: dict[str, Any] = _f({})


@dataclass
class EvalConfig:
    every: int = _f(1, ge=1)
    batch_size: int = _f(2048, ge=1)
    # Evaluate the running average of the global iterates (AFL reports it).
    average_iterates: bool = False
    # Personalised evaluation by fine-tuning (FedBABU, Per-FedAvg): this many local
    # steps from the global model on each client's training data, then its test split
    # (finetune_acc_*; fedloom.engine.evaluation.evaluate_finetuned). 0: off.
    finetune_steps: int = _f(0, ge=0)


@dataclass
class CheckpointConfig:
    every: int = _f(10, ge=0)  # 0 disables checkpoints


@dataclass
class LoggingConfig:
    """Where each round's metrics go besides ``metrics.jsonl`` (always written: the
    record a resume checks); see :mod:`fedloom.engine.runlog`. Not part of what a
    resume compares: a run may be continued with other logging."""

    csv: bool = True           # RUN/metrics.csv, the same rows as metrics.jsonl
    tensorboard: bool = False  # RUN/tensorboard: scalars (needs the tensorboard package)
    # RUN/curves.png etc. (matplotlib, when installed); a sweep's runs turn them off: its
    # page draws its own, and importing matplotlib is a second of every short run
    plots: bool = True


@dataclass
class StateConfig:
    """Per-client state storage: ``auto`` picks dense below ``memmap_above_mb``."""

    storage: Literal["auto", "dense", "memmap"] = "auto"
    dtype: Literal["float32", "float16"] = "float32"
    memmap_above_mb: float = _f(1024.0, gt=0)


@dataclass
class BackendConfig:
    """Where client training runs. ``backend: NAME`` is short for ``backend: {name: NAME}``.

    - ``sequential``: one client after another in this process;
    - ``vmap``: a cohort in lock-step with ``torch.func`` (chunks of ``chunk`` clients);
    - ``lockstep``: a cohort as one batched model (``baddbmm`` forward, hand-written
      backward, one fused SGD step; chunks of ``chunk`` clients) for chains of
      Linear/Conv2d/pooling/GroupNorm/BatchNorm/ReLU/Dropout/Flatten, bit for bit the
      sequential results in float64; anything else trains on the sequential path (one log line;
      :mod:`fedloom.engine.lockstep`);
    - ``auto``: lockstep on a CPU run it supports with a cohort of at least 2 (its rule,
      :mod:`fedloom.engine.auto`); otherwise times the first cohort on sequential, vmap,
      lockstep and process (where they apply), keeps the fastest and logs the times;
    - ``process``: ``workers`` single-thread processes on this machine, each running
      ``inner`` (sequential, vmap or lockstep) on its share of the cohort;
    - ``ray``: Ray tasks (``address`` joins a cluster; empty starts a local one).

    ``process`` and ``ray``: work whose worker process dies is run again up to
    ``max_retries`` times (``on_failure: retry``; then the run stops with an
    error) or its clients are dropped for the round (``drop``). A dead process
    worker affects its own group only: the other workers go on, and the dead one
    is replaced (also when it is found dead between rounds, where nothing is lost).

    ``threads``: torch's intra-op threads for the run (0 = the process's own count,
    every core in a fresh process; process and Ray workers: 1 each unless set);
    the summary records them (``threads``). On a busy machine fewer threads are
    much faster: OpenMP threads spin-wait for cores other processes hold.

    Why ``sequential`` stays the default when the machine has more cores: ``auto``
    was not measurably faster on the reference workload of benchmarks/bench.py
    (100 clients × 600 samples, MLP 784-200-10, 10 clients a round; one
    measurement each, 2-core machine, seconds a round after the first):

    - machine idle (load 2): sequential 0.27 (2 threads), 0.38 (1 thread);
      vmap (1 thread) 0.68; ``auto`` 0.81–0.84 — it chose ``process`` because its
      timing of the first cohort on ``sequential`` (3.3 s) included the cold
      start of the first round, so it was 3× slower than the default;
    - machine shared (load 12 on 2 cores): sequential 38–103 (2 threads),
      1.9–3.7 (``threads: 1``); vmap (1 thread) 1.7–2.1; ``auto`` 3.1–3.5
      (``process`` again), after a first round of 118 s that timed the three.

    ``threads: 1`` is what pays on a shared machine, not ``auto``.
    """

    name: str = "sequential"
    workers: int = _f(0, ge=0)        # process / ray: parallel workers (0 = every core)
    inner: Literal["sequential", "vmap", "lockstep"] = "sequential"
    chunk: int = _f(0, ge=0)          # vmap, lockstep: clients per chunk (0 = cache-sized)
    address: str = ""                 # ray: cluster address ("" = start a local instance)
    on_failure: Literal["retry", "drop"] = "retry"
    max_retries: int = _f(2, ge=0)    # process / ray: reruns of work whose worker died
    # torch intra-op threads (fedloom.device.apply_threads): 0 = the process's own count
    # (every core in a fresh process); process and ray workers: 0 = 1 each.
    threads: int = _f(0, ge=0)
    gpus_per_worker: float = _f(0.0, ge=0)  # ray: GPUs a task reserves (Ray's num_gpus)


@dataclass
class AttackConfig:
    """Byzantine clients (fedloom.attack; none by default): ``fraction`` of the
    population, drawn once from ``(seed, "attack")``, send attack ``name``'s
    transform of their update (``options`` go to its factory)."""

    name: str = "sign_flip"
    fraction: float = _f(0.0, ge=0, le=1)
    options: dict[str, Any] = _f({})


@dataclass
class DeviceClass:
    """One row of ``system.classes``: a device class and its share ``p`` of the clients."""

    name: str = ""
    p: float = _f(0.0, ge=0, le=1)
    speed: float = _f(0.0, ge=0)       # samples/s (0: local work takes no time)
    up_bps: float = _f(0.0, ge=0)      # bit/s (0: the uplink takes no time)
    down_bps: float = _f(0.0, ge=0)
    latency_s: float = _f(0.0, ge=0)   # per message, each way


@dataclass
class SystemConfig:
    """Simulated devices, links and availability (:mod:`fedloom.system`; off by default).

    ``profile`` draws each client's ``speed`` (samples/s), ``up_bps``/``down_bps``
    (bit/s) and ``latency_s`` once from ``(seed, client)``: ``uniform`` takes each
    as ``[low, high]``, ``lognormal`` as ``[median, sigma]`` (a single number is that
    value for every client; 0 means the term takes no time); ``classes`` picks a row of
    ``classes`` with probability ``p``; ``csv`` reads ``path``
    (``client,speed,up_bps,down_bps,latency``). ``deadline_s`` closes a round; a late
    client is dropped or does the steps that fit (``late: partial``). ``availability``,
    ``pattern`` (``sine``/``onoff`` over ``period`` rounds, a per-client phase) and
    ``dropout`` (mid-round) decide who can take part.
    """

    profile: Literal["off", "uniform", "lognormal", "classes", "csv"] = "off"
    speed: float | list[float] = _f(0.0, ge=0)
    up_bps: float | list[float] = _f(0.0, ge=0)
    down_bps: float | list[float] = _f(0.0, ge=0)
    latency_s: float | list[float] = _f(0.0, ge=0)
    classes: list[DeviceClass] = _f([])
    path: str = ""
    deadline_s: float | None = _f(None, gt=0)
    late: Literal["drop", "partial"] = "drop"
    availability: float = _f(1.0, gt=0, le=1)
    pattern: Literal["none", "sine", "onoff"] = "none"
    period: int = _f(24, ge=2)
    amplitude: float = _f(0.0, ge=0, le=1)
    on_fraction: float = _f(0.5, gt=0, le=1)
    dropout: float = _f(0.0, ge=0, lt=1)


@dataclass
class AdaptiveClipConfig:
    """Quantile-based clipping (Andrew et al. 2021): ``C ← C·exp(−lr (b̃ − target_quantile))``
    from the noisy fraction ``b̃`` of unclipped updates (noise ``count_stddev``;
    null = cohort.size / 20). Central mode only."""

    enabled: bool = False
    target_quantile: float = _f(0.5, gt=0, lt=1)
    lr: float = _f(0.2, gt=0)
    count_stddev: float | None = _f(None, gt=0)


@dataclass
class PrivacyConfig:
    """Client-level differential privacy (fedloom.privacy): ``central`` (DP-FedAvg:
    clip each update to ``clip``, Gaussian noise ``noise_multiplier · clip`` on the
    sum at the server) or ``local`` (each client clips and adds that noise before
    compression). ``dp_epsilon`` at ``delta`` is reported each round; with
    ``target_epsilon`` the run stops before a round that would exceed it."""

    mode: Literal["none", "central", "local"] = "none"
    clip: float = _f(1.0, gt=0)
    noise_multiplier: float = _f(1.0, ge=0)
    delta: float = _f(1e-5, gt=0, lt=1)
    target_epsilon: float | None = _f(None, gt=0)
    adaptive_clip: AdaptiveClipConfig = field(default_factory=AdaptiveClipConfig)


@dataclass
class Config:
    name: str = "experiment"
    # an identifier, hashed into every random stream: no MAX_COUNT (field_bounds)
    seed: int = field(default=0, metadata={"unbounded": True})
    rounds: int = _f(30, ge=1)
    # cpu | cuda | cuda:N | auto (CUDA when available); see fedloom.device
    device: str = "cpu"
    backend: BackendConfig = field(default_factory=BackendConfig)
    dtype: Literal["float32", "float64"] = "float32"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cohort: CohortConfig = field(default_factory=CohortConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    aggregator: AggregatorConfig = field(default_factory=AggregatorConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    state: StateConfig = field(default_factory=StateConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    system: SystemConfig = field(default_factory=SystemConfig)


# --------------------------------------------------------------------------- parsing
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}: must be {_type_name(tp)}, got {_shown(value)}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(value, arg, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: must be {_type_name(tp)}, got {_shown(value)}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{path}: must be null, got {_shown(value)}")
        return None
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: must be {_type_name(tp)}, got {_shown(value)}")
        (inner,) = typing.get_args(tp)
        return [_convert(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: must be a mapping, got {_shown(value)}")
        return {str(k): v for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: must be a mapping, got {_shown(value)}")
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {_shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: must be an integer, got {_shown(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: must be a number, got {_shown(value)}")
        try:
            value = float(value)
        except OverflowError:  # an int beyond float's range (10**309): not finite either
            raise ConfigError(f"{path}: must be finite, got {_shown(value)}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{path}: must be finite, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: must be a string, got {_shown(value)}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"config schema: unsupported type {tp!r} at {path}")  # pragma: no cover


def _digits(n: int) -> int:
    """The decimal digits of ``n``, without ``str(n)`` (which raises past Python's
    int-to-str limit, 4300 digits)."""
    n = abs(n)
    if n < 10:
        return 1
    d = int(math.log10(n)) + 1
    if 10 ** (d - 1) > n:  # log10's rounding, near a power of ten
        return d - 1
    return d + 1 if 10**d <= n else d


def _shown(v: Any) -> str:
    """``repr(v)`` for a message; an integer of more than 30 digits by its length (a
    message stays one short line, and repr raises past Python's int-to-str limit)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"an integer of {_digits(v)} digits"
    return repr(v)


def field_bounds(f: dataclasses.Field[Any], tp: Any) -> dict[str, float]:
    """The bounds loading checks ``f`` (of type ``tp``) against, and the schema states:
    its own (``_f(default, ge=…)``), plus ``le=MAX_COUNT`` for a field that holds
    integers (``int``, ``int | None``, ``list[int]``) without an upper bound of its
    own, unless it is marked ``unbounded`` (``seed``)."""
    bounds = dict(f.metadata.get("bounds", {}))
    if not f.metadata.get("unbounded") and _holds_int(tp) and not {"le", "lt"} & set(bounds):
        bounds["le"] = MAX_COUNT
    return bounds


def _holds_int(tp: Any) -> bool:
    if tp is int:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType, list):
        return any(_holds_int(a) for a in typing.get_args(tp))
    return False


def _check_bounds(value: Any, bounds: Mapping[str, float], path: str) -> None:
    if value is None or isinstance(value, str):  # a keyword ("auto") has no bounds
        return
    values = value if isinstance(value, list) else [value]
    for v in values:
        for op, b in bounds.items():
            ok = {"ge": v >= b, "gt": v > b, "le": v <= b, "lt": v < b}[op]
            if not ok:
                sym = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}[op]
                why = " (the bound of every count: fedloom.config.MAX_COUNT)" if (
                    op == "le" and b == MAX_COUNT) else ""
                shown = str(b) if isinstance(b, int) else f"{b:g}"
                raise ConfigError(f"{path}: must be {sym} {shown}{why}, got {_shown(v)}")


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(
                f"{where}: unknown key (expected one of: {', '.join(sorted(fields))})"
            )
    kwargs = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name in data:
            value = _convert(data[name], hints[name], where)
            _check_bounds(value, field_bounds(f, hints[name]), where)
            kwargs[name] = value
    return cls(**kwargs)


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Validate a plain mapping into a :class:`Config` (raises :class:`ConfigError`)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: must be a mapping at the top level, got {type(data).__name__}")
    cfg = _build(Config, _shorthands(data), "")
    _check_cross_fields(cfg)
    return cfg


def _shorthands(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``backend: NAME`` → ``backend: {name: NAME}``."""
    if isinstance(data.get("backend"), str):
        return {**data, "backend": {"name": data["backend"]}}
    return data


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def check_name(field: str, kind: str, name: str) -> None:
    """Raise a one-line ``ConfigError`` naming ``field`` if ``name`` is neither
    registered, nor an installed entry point, nor an importable ``module:attr``."""
    try:
        registry.get(kind, name)
    except KeyError as e:
        msg = e.args[0] if e.args else str(e)
        if msg.startswith("unknown "):
            msg = f"unknown {kind} {name!r} (available: {', '.join(registry.available(kind))})"
        raise ConfigError(f"{field}: {msg}") from None


def metric_names(metrics: Any) -> list[str]:
    """``metrics.hooks``, then every boolean key of the section that is true and
    names a registered metric (``metrics.mismatch: true``), without repeats."""
    names = list(getattr(metrics, "hooks", []) or [])
    known = set(registry.available("metric"))
    for f in dataclasses.fields(metrics):
        if getattr(metrics, f.name) is True and f.name in known and f.name not in names:
            names.append(f.name)
    return names


# The per-device quantities of the system section (fedloom.system).
SYSTEM_QUANTITIES = ("speed", "up_bps", "down_bps", "latency_s")


def system_values(cfg: SystemConfig, q: str) -> list[float]:
    v = getattr(cfg, q)
    return [float(v)] if isinstance(v, int | float) else [float(x) for x in v]


def check_system_config(cfg: SystemConfig) -> None:
    """Raise :class:`ConfigError` (one line naming the ``system.*`` field) for a
    section that cannot describe devices."""
    p = cfg.profile
    for q in SYSTEM_QUANTITIES:
        v = system_values(cfg, q)
        given = v != [0.0]
        if p in ("off", "classes", "csv") and given:
            why = "system.profile is off" if p == "off" else f"profile {p} gives it"
            raise ConfigError(f"system.{q}: not used ({why})")
        if len(v) not in (1, 2):
            raise ConfigError(f"system.{q}: one number, or [low, high] (uniform) / "
                              f"[median, sigma] (lognormal), got {len(v)} numbers")
        if p == "uniform" and len(v) == 2:
            if v[0] > v[1]:
                raise ConfigError(f"system.{q}: low {v[0]:g} is above high {v[1]:g}")
            if q != "latency_s" and v[0] == 0 and v[1] > 0:
                raise ConfigError(f"system.{q}: low must be > 0 (0 alone means the term "
                                  "takes no time)")
    if p == "classes":
        if not cfg.classes:
            raise ConfigError("system.classes: profile classes needs at least one class")
        total = sum(c.p for c in cfg.classes)
        if abs(total - 1.0) > 1e-6:
            raise ConfigError(f"system.classes: the probabilities p must sum to 1, got {total:g}")
    elif cfg.classes:
        raise ConfigError(f"system.classes: not used (system.profile is {p})")
    if p == "csv" and not cfg.path:
        raise ConfigError("system.path: profile csv needs the file of the clients' devices")
    if p != "csv" and cfg.path:
        raise ConfigError(f"system.path: not used (system.profile is {p})")
    if cfg.deadline_s is not None and p == "off":
        raise ConfigError("system.deadline_s: needs a system.profile to time the clients")
    if cfg.pattern != "sine" and cfg.amplitude:
        raise ConfigError("system.amplitude: only used by pattern sine")


_OLDER_PARTITION_KEYS = frozenset({"name", "alpha", "min_samples", "shards_per_client",
                                   "max_tries", "min_policy", "balance"})


def _check_partition_keys(p: PartitionConfig) -> None:
    """A key of the heterogeneity partitioners (``k``, ``sizes``' and ``mixed``'s keys,
    ``options``) set away from its default for a partitioner that does not take it is
    refused (one line), as an unknown option is: it would be ignored. The older keys
    (``alpha``, ``min_samples``, …) stay ignored by partitioners that do not take them,
    as before: configs switch the partitioner by override (``data.partition.name=iid``)
    and keep their Dirichlet keys."""
    import inspect

    factory = registry.get("partitioner", p.name)
    takes = set(inspect.signature(factory).parameters)
    if any(v.kind is inspect.Parameter.VAR_KEYWORD
           for v in inspect.signature(factory).parameters.values()):
        if p.name != "mixed" or not getattr(factory, "__module__", "").startswith("fedloom."):
            return
        then = p.then or "dirichlet"
        try:
            takes |= set(inspect.signature(registry.get("partitioner", then)).parameters)
        except KeyError as e:
            raise ConfigError(f"data.partition.then: {e.args[0] if e.args else e}") from None
    if not getattr(factory, "__module__", "").startswith("fedloom."):
        return  # a plug-in takes the keys it names; the others are its business
    default = PartitionConfig()
    for f in dataclasses.fields(PartitionConfig):
        if f.name in _OLDER_PARTITION_KEYS or getattr(p, f.name) == getattr(default, f.name):
            continue
        if f.name not in takes:
            raise ConfigError(f"data.partition.{f.name}: not used by partitioner {p.name!r}")


def _check_cross_fields(cfg: Config) -> None:
    check_name("data.name", "dataset", cfg.data.name)
    check_name("model.name", "model", cfg.model.name)
    check_name("aggregator.name", "aggregator", cfg.aggregator.name)
    check_name("backend.name", "backend", cfg.backend.name)
    check_name("client.method", "method", cfg.client.method)
    check_name("compression.name", "compressor", cfg.compression.name)
    check_name("server.optimizer", "server_optimizer", cfg.server.optimizer)
    check_name("compression.feedback", "feedback", cfg.compression.feedback)
    check_name("compression.adaptive", "planner", cfg.compression.adaptive)
    check_name("data.partition.name", "partitioner", cfg.data.partition.name)
    _check_partition_keys(cfg.data.partition)
    for i, hook in enumerate(cfg.metrics.hooks):
        check_name(f"metrics.hooks[{i}]", "metric", hook)
    on = metric_names(cfg.metrics)
    for hook, opts in cfg.metrics.options.items():
        if hook not in on:
            raise ConfigError(f"metrics.options.{hook}: metric {hook!r} is not on (on: "
                              f"{', '.join(on) or 'none'}; add it to metrics.hooks)")
        if not isinstance(opts, Mapping):
            raise ConfigError(f"metrics.options.{hook}: must be a mapping, got {opts!r}")
    check_name("attack.name", "attack", cfg.attack.name)
    if cfg.logging.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("logging.tensorboard: needs the tensorboard package "
                              "(pip install 'fedloom[tensorboard]')")
    if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", cfg.device):
        raise ConfigError(f"device: must be cpu, cuda, cuda:N or auto, got {cfg.device!r}")
    # Every compressor takes it (the payload's CRC-32C trailer): checked here, not
    # first when the experiment builds its compressor.
    checksum = cfg.compression.options.get("checksum", True)
    if not isinstance(checksum, bool):
        raise ConfigError(f"compression.options.checksum: must be true or false, "
                          f"got {checksum!r}")
    natural = cfg.data.partition.name == "natural" or bool(cfg.data.client)
    if not natural and cfg.cohort.size > cfg.data.num_clients:
        raise ConfigError(
            f"cohort.size: must be <= data.num_clients ({cfg.data.num_clients}), "
            f"got {cfg.cohort.size}"
        )
    check_system_config(cfg.system)
    if cfg.client.schedule.name == "cosine" and cfg.client.schedule.warmup >= cfg.rounds:
        raise ConfigError(
            f"client.schedule.warmup: must be < rounds ({cfg.rounds}), "
            f"got {cfg.client.schedule.warmup}"
        )


# ------------------------------------------------------------------- YAML + overrides
# What aliases may add to a document, in nodes of the tree they expand to, and how
# deep a document may nest. A config is a few hundred nodes, eight levels deep; an
# alias bomb (nine anchors, each nine aliases of the one before) is 9**9 leaves.
MAX_ALIAS_NODES = 10_000
MAX_DEPTH = 100


class _Refused(yaml.MarkedYAMLError):
    """A document refused while composing it (raised as ConfigError by _load)."""


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts, while composing, the nodes aliases add.

    PyYAML composes an alias as the anchored node itself, so the composed graph is
    as small as the file, but every consumer that walks it as a tree
    (``dataclasses.asdict``, ``==``, the schema's own checks) visits each alias's whole
    subtree again. Each node's expanded size (itself plus its children's, an alias
    counting as its target's) is recorded when its composition ends; an alias adds
    its target's size to the document's running extra, refused past
    :data:`MAX_ALIAS_NODES`. An alias to a node still being composed is recursive
    (a list that holds itself: an endless tree) and refused; so is nesting deeper
    than :data:`MAX_DEPTH` (PyYAML's composer recurses per level: a RecursionError
    after ~490 levels otherwise, at the default recursion limit). A merge key
    (``<<: *a``) is an alias like any other, counted as its target's size, an
    upper bound of the entries it copies.
    The work is one step per composed node, whatever the expansion would be."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}   # id(node) -> expanded size, once composed
        self._open: list[int] = []         # expanded size so far of each open node
        self._extra = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._alias(self.peek_event())
            return super().compose_node(parent, index)
        if len(self._open) >= MAX_DEPTH:
            raise _Refused(problem=f"nested more than {MAX_DEPTH} levels deep",
                           problem_mark=self.peek_event().start_mark)
        self._open.append(1)
        node = super().compose_node(parent, index)
        size = self._open.pop()
        self._sizes[id(node)] = size
        if self._open:
            self._open[-1] += size
        return node

    def _alias(self, event: yaml.AliasEvent) -> None:
        target = self.anchors.get(event.anchor)
        if target is None:  # an undefined alias: the composer's own error follows
            return
        size = self._sizes.get(id(target))
        if size is None:
            raise _Refused(problem=f"recursive alias *{event.anchor} (an anchor used "
                                   "inside itself)", problem_mark=event.start_mark)
        self._extra += size
        if self._extra > MAX_ALIAS_NODES:
            raise _Refused(problem=f"aliases expand to more than {MAX_ALIAS_NODES} "
                                   "nodes; write the values out", problem_mark=event.start_mark)
        if self._open:
            self._open[-1] += size


def _construct_int(loader: _BoundedLoader, node: yaml.ScalarNode) -> int:
    """``SafeConstructor.construct_yaml_int``, refusing (with its line) an integer
    longer than Python's int-parsing limit: ``int()`` raises a ValueError that names
    neither the file nor the line."""
    try:
        return int(yaml.SafeLoader.construct_yaml_int(loader, node))
    except ValueError:
        raise _Refused(problem=f"an integer of more than {sys.get_int_max_str_digits()} "
                               "digits", problem_mark=node.start_mark) from None


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


class _Loader(_BoundedLoader):
    """YAML with 1.2-style floats: ``1e-3`` is a number, not the string "1e-3"."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _load(text: str, source: str, loader: type[yaml.SafeLoader]) -> Any:
    try:
        return yaml.load(text, Loader=loader)
    except _Refused as e:
        mark = e.problem_mark
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{source}: {e.problem}{where}") from None


def yaml_load(text: str, source: str = "YAML text") -> Any:
    """A config's YAML (1.2-style floats), bounded as :class:`_BoundedLoader` says:
    an alias bomb, a recursive alias or deep nesting raises :class:`ConfigError`
    naming ``source`` and the line; malformed YAML raises ``yaml.YAMLError``."""
    return _load(text, source, _Loader)


def safe_load_bounded(text: str, source: str) -> Any:
    """``yaml.safe_load`` (YAML 1.1 resolvers, the ones ``yaml.safe_dump`` writes
    for) with :func:`yaml_load`'s bounds: for files fedloom wrote, such as a run
    directory's ``config.yaml``, whose strings like ``1e5`` must stay strings."""
    return _load(text, source, _BoundedLoader)


def _parse_value(text: str, key: str) -> Any:
    try:
        return yaml_load(text, f"override {key}") if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested mapping (a copy is returned)."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE with a dotted key")
        parts = key.split(".")
        if parts[0] == "backend" and len(parts) > 1 and isinstance(out.get("backend"), str):
            out["backend"] = {"name": out["backend"]}
        node: dict[str, Any] = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a section, cannot set {key}")
            node = nxt
        value = _parse_value(raw, key)
        if key == "backend" and isinstance(value, str):
            # the shorthand ``backend=NAME`` keeps the section's other keys
            old = node.get("backend")
            value = {**(old if isinstance(old, dict) else {}), "name": value}
        node[parts[-1]] = value
    return out


def load_config(
    source: str | Path | Mapping[str, Any] | Config, overrides: Sequence[str] = ()
) -> Config:
    """Load a config from a YAML file, a mapping or a :class:`Config`, then apply overrides."""
    if isinstance(source, Config):
        data = config_to_dict(source)
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            # utf-8-sig: a byte-order mark is skipped; other encodings are refused,
            # never guessed from the locale.
            text = path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a UTF-8 text file (byte 0x{e.object[e.start]:02x} "
                              f"at offset {e.start})") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
        try:
            data = yaml_load(text, str(path))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError(f"{path}: not valid YAML{where}") from None
        if data is None:  # no document, or only ``null``: never the defaults, silently
            raise ConfigError(f"{path}: the file has no settings (it is empty or holds "
                              "only comments)")
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: must hold a mapping at the top level")
        data.setdefault("name", path.stem)
    return config_from_dict(apply_overrides(data, overrides))
