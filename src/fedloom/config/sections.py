"""The config's sections: one dataclass per section, with its defaults and bounds.

:class:`Config` is the root. A field's bounds (``_f(default, ge=…)``) are what
loading checks (:func:`fedloom.config.checks.field_bounds`) and what ``fedloom
schema`` states. :class:`ConfigError` is here too: the one error every part of
:mod:`fedloom.config` raises.

Counts are bounded: every integer field but ``seed`` (rounds, clients, samples,
batch sizes, local steps and epochs, eval and checkpoint intervals, widths) is at
most :data:`MAX_COUNT` = 10**9, stated as ``maximum`` in ``fedloom schema``
(``rounds=10**12`` and ``2**63`` were accepted and ran). ``seed`` is an identifier,
hashed into every random stream (:mod:`fedloom.rng`), and has no bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal


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
        def copy() -> Any:  # a fresh list or dict per instance, of the default's type
            return type(default)(default)

        return field(default_factory=copy, metadata=_rng(**bounds))
    return field(default=default, metadata=_rng(**bounds))


@dataclass
class PartitionConfig:
    """``data.partition``: the partitioner (iid, contiguous, dirichlet, shards, natural,
    classes, sizes, mixed, ``flwr:NAME`` (a flwr-datasets partitioner), a plug-in or
    module:attr; :mod:`fedloom.data.partition`) and its factory's options: dirichlet's
    ``alpha`` (one α, or one per class), ``min_samples``, ``max_tries``, ``min_policy``,
    ``balance``; shards' ``shards_per_client``; classes' ``k``, ``assign``, ``split``;
    sizes' ``distribution``, ``exponent``, ``sigma``, ``counts``, ``then``; mixed's
    ``iid_fraction``, ``then`` and the options of ``then``; flwr:NAME's, those of its
    class (``num_partitions``, ``partition_by`` and ``seed`` are fedloom's). The
    factory's signature states each option's type and bounds (``fedloom algorithms``);
    ``partition: NAME`` is short for ``{name: NAME}``."""

    name: str = "dirichlet"
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
    """``data``: the source (synthetic, digits, mnist, fashion-mnist, shakespeare, text,
    npz, csv, cifar10, cifar100, femnist, tiny-imagenet, image-folder, hf, a plug-in or
    module:attr; :mod:`fedloom.data.sources`) and its loader's options (synthetic:
    ``alpha``, ``beta``, ``dim``, ``classes``; shakespeare: ``path``, ``window``,
    ``stride``, ``min_chars``, ``max_clients``, ``max_windows``; text: ``path``,
    ``seq_len``, ``stride``, ``tokenizer``, ``min_chars``, ``max_clients``,
    ``max_windows``, ``clients``; npz: ``path``; csv: ``path``, ``label``, ``client``,
    ``features``; the sources read from disk: ``root``, ``verify`` (not femnist),
    cifar100's ``labels``, femnist's ``writer_fraction``, image-folder's and hf's
    ``path``, image-folder's ``image_size``, hf's ``label``, ``client``,
    ``image_column``, ``max_client_samples``), beside the keys every source shares. A
    loader is called ``loader(data, seed, **options)`` (``data``: this section); its
    signature states each option's type, bounds and default (docs/howto/datasets.md)."""

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
    # The source's own keys: keyword arguments of its loader.
    options: dict[str, Any] = _f({})
    # Standardise every feature with the mean/std of the clients' training parts.
    standardize: bool = False
    # Every client needs at least this many samples (checked for natural splits).
    min_samples: int = _f(1, ge=1)
    # Training augmentation (fedloom.data.augment): "auto" = the source's standard one
    # (random crop with padding 4 and horizontal flip for CIFAR and Tiny-ImageNet; none
    # for the others), "standard" = the same, refused where a source has none.
    augment: Literal["auto", "none", "standard"] = "auto"


@dataclass
class LoRAConfig:
    """``model.options.lora``: low-rank adapters (Hu et al. 2021) on the named projections of
    ``hf_causal_lm``; ``r: 0`` trains every parameter (no adapter)."""

    r: int = _f(0, ge=0)
    alpha: int = _f(16, ge=1)          # the scale is alpha / r (peft: an integer)
    dropout: float = _f(0.0, ge=0, lt=1)
    target_modules: list[str] = _f(["q_proj", "v_proj"])
    # which factors train (and so are in the Layout, sent and aggregated): "b" is
    # FFA-LoRA's (Sun et al. 2024): A frozen at its random init, the same on every client
    train: Literal["both", "b"] = "both"


@dataclass
class ModelConfig:
    """``model``: the model (mlp, cnn, resnet, char_rnn, hf_causal_lm, the papers' models
    of :mod:`fedloom.models.zoo`, a plug-in or module:attr) and its factory's options
    (mlp: ``hidden``, ``activation``; cnn and the papers' CNNs: ``channels``; resnet:
    ``depth``, ``width``, ``norm``; char_rnn: ``embed``, ``hidden``, ``cell``;
    hf_causal_lm: ``path``, ``gguf_file``, ``config``, ``lora``,
    ``gradient_checkpointing``, ``base_dtype``). A factory is called
    ``factory(in_shape, num_classes, **options)``; its signature states each option's
    type, bounds and default (``fedloom algorithms``). ``model: NAME`` is short for
    ``{name: NAME}``."""

    name: str = "mlp"
    options: dict[str, Any] = _f({})
    # What the server does with module buffers (BatchNorm statistics) after a round:
    # average (data-weighted), local (per client, FedBN), keep_global (never updated).
    # See fedloom.buffers. A key of its own: the server's policy, not the model's.
    buffers: Literal["average", "local", "keep_global"] = "average"


@dataclass
class SelectionConfig:
    """``cohort.selection``: the client selector (uniform, power_of_choice, oort, a plug-in
    or module:attr; :mod:`fedloom.selection`) and its factory's options; ``selection:
    NAME`` is short for ``{name: NAME}``."""

    name: str = "uniform"
    options: dict[str, Any] = _f({})


@dataclass
class CohortConfig:
    """Who trains in a round: ``size`` clients chosen by ``selection``, or under ``sampling:
    poisson`` each client with probability ``rate`` (the cohort's size varies, 0 included)."""

    size: int = _f(10, ge=1)
    # Who of the available clients trains in a round (default: uniformly at random).
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    # fixed: `size` clients a round, chosen by `selection`; poisson: each client
    # independently with probability `rate`, and under privacy.mode central ε is the
    # Poisson-sampled Gaussian's at q with multiplier z, where fixed-size cohorts cost
    # z/2 (2.955 against 20.62 at q = 0.01, z = 1, 2,000 rounds, δ = 1e-6; PLD):
    # docs/howto/privacy.md, Poisson sampling
    sampling: Literal["fixed", "poisson"] = "fixed"
    # q of poisson sampling, whose expected cohort q·N is DP-FedAvg's denominator;
    # None: size / data.num_clients
    rate: float | None = _f(None, gt=0, le=1)


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
class MethodConfig:
    """``client.method``: the local method and its factory's options (``client.method:
    NAME`` is short for ``{name: NAME}``)."""

    name: str = "sgd"
    options: dict[str, Any] = _f({})


@dataclass
class ClientConfig:
    """Local training. ``lr`` stays a key of its own, not an option of the method: it is
    the step size every comparison tunes, for every method. So do ``prox_mu`` (FedProx's
    μ) and ``weight_decay``: suites and tuning spaces set them by a dotted key, which an
    entry of ``client.transforms`` has not, and their terms take fixed places in the
    step (before the method's own terms; the config's ``transforms`` come after them)."""

    lr: float = _f(0.01, gt=0)
    momentum: float = _f(0.0, ge=0, lt=1)
    weight_decay: float = _f(0.0, ge=0)
    batch_size: int = _f(32, ge=1)
    epochs: int = _f(1, ge=1)
    # A fixed number of local steps; when set it replaces `epochs`.
    steps: int | None = _f(None, ge=1)
    prox_mu: float = _f(0.0, ge=0)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    # Local method: sgd (FedAvg/FedProx), scaffold, ditto, …, a plug-in or module:attr.
    method: MethodConfig = field(default_factory=MethodConfig)
    # Mixed precision of the local forward/loss (fedloom.client.sgd.LocalSGD.amp): off by default.
    amp: Literal["none", "bf16", "fp16"] = "none"
    # More terms of the local step's direction ({name, options} each; a registered
    # transform, entry point or module:attr; fedloom.client.transforms), applied
    # after the method's own and before momentum, on every client backend.
    transforms: list[dict[str, Any]] = _f([])


@dataclass
class ServerOptimizerConfig:
    """``server.optimizer``: sgd, momentum, adam, yogi, adagrad, a plug-in or module:attr,
    and its factory's options (``momentum``; ``beta1``, ``beta2``, ``eps``); ``server.optimizer:
    NAME`` is short for ``{name: NAME}``."""

    name: str = "sgd"
    options: dict[str, Any] = _f({})


@dataclass
class ServerConfig:
    """Server step ``w ← w − lr · opt(agg)`` (Reddi et al. 2021, FedOpt).

    ``lr`` stays a key of its own, not an option of ``optimizer``: it is the step size
    every comparison tunes, for every aggregator and optimizer (the optimizer's
    factory receives it besides its options)."""

    optimizer: ServerOptimizerConfig = field(default_factory=ServerOptimizerConfig)
    # "auto": the aggregator's default step for its options (its `default_server_lr`:
    # 0.1 for CRAFT at step fixed, 1.0 for its default rprop step and the FedAvg
    # family); the number used is what the run directory's config.yaml and
    # summary.json record.
    lr: float | Literal["auto"] = _f("auto", gt=0)
    # Screening of client updates before any aggregator
    # (fedloom.engine.stages.screen.screen_updates):
    # reject an update whose L2 norm exceeds `max_update_norm` (null = no bound) or
    # `max_norm_ratio` × the cohort's lower median norm (null = off), then clip each
    # accepted one to `clip_norm` (norm bounding, Sun et al. 2019; null = off).
    max_update_norm: float | None = _f(None, gt=0)
    max_norm_ratio: float | None = _f(1e4, gt=1)
    clip_norm: float | None = _f(None, gt=0)
    # Steps on the accepted rows before the aggregator, in order ({name, options} each:
    # nnm, bucketing, a plug-in or module:attr; fedloom.aggregate.pre): NNM then Krum.
    pre_aggregation: list[dict[str, Any]] = _f([])
    # The server sees only the sum of the masked updates (SecAgg+): refuses aggregators
    # and compressors a sum-only server cannot compute (fedloom.privacy).
    secure_aggregation: bool = False


@dataclass
class AggregatorConfig:
    name: str = "fedavg"
    options: dict[str, Any] = _f({})


@dataclass
class FeedbackConfig:
    """``compression.feedback``: the error-feedback policy (none, ef, saef, sapef, ef21,
    cser, scafcom, flare, ec_prox, a plug-in or module:attr) and its factory's options
    (sapef: ``alpha``, ``alpha_schedule``, ``alpha_kappa``; cser: ``period``,
    ``reset_ratio``; scafcom: ``beta``; ef21: ``ef21_mean``; flare, ec_prox: ``tau``,
    ``tau_decay``, flare also ``penalty_steps``, ``penalty``); ``feedback: NAME`` is short
    for ``{name: NAME}``. The factory's signature states each option's type and bounds
    (``fedloom algorithms``)."""

    name: str = "none"
    options: dict[str, Any] = _f({})


@dataclass
class PlannerConfig:
    """``compression.adaptive``: a round planner (:mod:`fedloom.hooks`: none, ffl, a plug-in
    or module:attr) and its factory's options; ``adaptive: NAME`` is short for ``{name:
    NAME}``. FFL (Nori et al.): rate ``R_t = R (L_0/L_t)^(1/3)`` and local epochs
    ``E_t = max(1, round(E (L_t/L_0)^(1/3)))`` from the global test loss ``L_t``."""

    name: str = "none"
    options: dict[str, Any] = _f({})


@dataclass
class CompressionConfig:
    """Uplink compression and error feedback (:mod:`fedloom.compress`)."""

    name: str = "identity"
    options: dict[str, Any] = _f({})
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    adaptive: PlannerConfig = field(default_factory=PlannerConfig)


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
    # The last ⌈window · rounds⌉ rounds are evaluated every round, whatever `every`:
    # the report's KEY_window metrics are their mean (fedloom.report.compare.run_stats).
    window: float = _f(0.0, ge=0, le=1)
    batch_size: int = _f(2048, ge=1)
    # Evaluate the running average of the global iterates (AFL reports it).
    average_iterates: bool = False
    # Personalised evaluation by fine-tuning (FedBABU, Per-FedAvg): this many local
    # steps from the global model on each client's training data, then its test split
    # (finetune_acc_*; fedloom.engine.stages.evaluation.evaluate_finetuned). 0: off.
    finetune_steps: int = _f(0, ge=0)

    def window_rounds(self, rounds: int) -> int:
        """``⌈window · rounds⌉`` (a product such as 0.1 · 30 = 3.0000000000000004 is 3)."""
        return min(rounds, math.ceil(round(self.window * rounds, 9)))

    def due(self, rnd: int, rounds: int) -> bool:
        """Whether round ``rnd`` (1 … ``rounds``) is evaluated: every ``every``-th, the
        last, and each of the last :meth:`window_rounds`."""
        return rnd % self.every == 0 or rnd == rounds or rnd > rounds - self.window_rounds(rounds)


@dataclass
class CheckpointConfig:
    every: int = _f(10, ge=0)  # 0 disables checkpoints


@dataclass
class LoggingConfig:
    """Where each round's metrics go besides ``metrics.jsonl`` (always written: the
    record a resume checks); see :mod:`fedloom.engine.runs.sinks`. Not part of what a
    resume compares: a run may be continued with other logging."""

    csv: bool = True           # RUN/metrics.csv, the same rows as metrics.jsonl
    tensorboard: bool = False  # RUN/tensorboard: scalars (needs the tensorboard package)
    # RUN/curves.png etc. (matplotlib, when installed); a sweep's runs turn them off: its
    # page draws its own, and importing matplotlib is a second of every short run
    plots: bool = True


@dataclass
class StateConfig:
    """Per-client state storage: ``auto`` picks memmap above ``memmap_above_mb``, else
    lazy (rows made when first written) above 65,536 clients, else dense."""

    storage: Literal["auto", "dense", "lazy", "memmap"] = "auto"
    dtype: Literal["float32", "float16"] = "float32"
    memmap_above_mb: float = _f(1024.0, gt=0)


@dataclass
class BackendConfig:
    """Where client training runs: the backend and its factory's options, whose
    signature is their schema (``fedloom algorithms``); ``backend: NAME`` is short for
    ``backend: {name: NAME}``. ``threads`` and ``keep_heap`` stay keys of their own:
    they hold for the whole run, whichever backend trains.

    - ``sequential``: one client after another in this process;
    - ``vmap``: a cohort in lock-step with ``torch.func`` (chunks of ``chunk`` clients);
    - ``lockstep``: a cohort as one batched model (``baddbmm`` forward, hand-written
      backward, one fused SGD step; chunks of ``chunk`` clients) for chains of
      Linear/Conv2d/pooling/GroupNorm/BatchNorm/ReLU/Dropout/Flatten, bit for bit the
      sequential results in float64; anything else trains on the sequential path (one log line;
      :mod:`fedloom.engine.trainers.lockstep`);
    - ``auto``: times the first cohort on sequential, lockstep, vmap (on a GPU), process
      and process+lockstep, where each applies, keeps the fastest and logs the table
      (:mod:`fedloom.engine.trainers.auto`);
    - ``process``: ``workers`` single-thread processes on this machine, each running
      ``inner`` (sequential, vmap or lockstep) on its share of the cohort;
    - ``ray``: Ray tasks (``address`` joins a cluster; empty starts a local one).

    ``process`` and ``ray``: work whose worker process dies is run again up to
    ``max_retries`` times (``on_failure: retry``; then the run stops with an
    error) or its clients are dropped for the round (``drop``). A dead process
    worker affects its own group only: the other workers go on, and the dead one
    is replaced (also when it is found dead between rounds, where nothing is lost).

    ``threads``: torch's intra-op threads for the run, 1 unless set (0 = the
    process's own count, every core in a fresh process; process and Ray workers: 1
    each unless set); the summary records them (``threads``). One by default because
    on a busy machine more are much slower (OpenMP threads spin-wait for cores
    other processes hold) and because float32 sums round by thread count: a run is
    bit for bit the same at equal thread counts, so the default is the same on every
    machine. Measurements: docs/howto/gpu.md (Threads).

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
    # the backend's options: process and ray: workers (0 = every core), inner,
    # on_failure, max_retries; vmap, lockstep, process, ray: chunk (clients per chunk,
    # 0 = cache-sized); ray: address ("" = start a local instance), gpus_per_worker
    options: dict[str, Any] = _f({})
    # torch intra-op threads (fedloom.device.apply_threads): 0 = the process's own count
    # (every core in a fresh process); process and ray workers: 0 = 1 each.
    threads: int = _f(1, ge=0)
    # glibc: the processes that train keep the heap memory a step frees for the next
    # (fedloom.device.keep_freed_heap; in this process it stays so after the run)
    keep_heap: bool = True


@dataclass
class AttackConfig:
    """Byzantine clients (fedloom.attack; none by default): ``fraction`` of the
    population, drawn once from ``(seed, "attack")``, send what attack ``name``
    computes from what it sees of the round (``options`` go to its factory;
    docs/howto/attacks.md)."""

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
    # The round mode (fedloom.engine.events): sync waits for the cohort; async applies
    # each arrival at once (FedAsync), buffered every `buffer` arrivals (FedBuff), both
    # with `concurrency` clients in flight (`buffer` is read by buffered only) and each
    # arrival weighted by s(τ) of its staleness τ (server steps since its dispatch):
    # constant 1, polynomial (1+τ)^-a, hinge 1 for τ ≤ b else 1/(a(τ−b)+1).
    mode: Literal["sync", "async", "buffered"] = "sync"
    concurrency: int = _f(10, ge=1)
    buffer: int = _f(10, ge=1)
    staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
    staleness_a: float = _f(0.5, ge=0)
    staleness_b: float = _f(4.0, ge=0)


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
class FtrlConfig:
    """DP-FTRL's participation and noise (fedloom.ftrl; ``privacy.mechanism`` tree or
    bandmf): clients split into ``groups`` by id, round r drawing from group r mod
    groups (each client's rounds ``groups`` apart); bandmf's ``bands`` (null: groups,
    at most groups); the tree restarted every ``restart_every`` rounds (null: one tree)."""

    groups: int = _f(1, ge=1)
    bands: int | None = _f(None, ge=1)
    restart_every: int | None = _f(None, ge=1)


@dataclass
class PrivacyConfig:
    """Client-level differential privacy (fedloom.privacy): ``central`` (DP-FedAvg:
    clip each update to ``clip``, Gaussian noise ``noise_multiplier · clip`` on the
    sum at the server) or ``local`` (each client clips and adds that noise before
    compression). ``dp_epsilon`` at ``delta`` is reported each evaluated round, by
    ``accountant`` (fedloom.accounting) under ``neighbours``; with ``target_epsilon``
    the run stops before a round that would exceed it, and ``noise_multiplier: auto``
    solves the noise for it over ``rounds`` (config.yaml holds the number).
    ``max_epsilon``: a run whose rounds would spend more refuses to start.
    ``accounting_population`` / ``accounting_cohort``: account for a deployment's
    cohort of that population while simulating ``cohort.size`` (the noise scaled so
    the mean's noise is the deployment's; pfl's noise_scale); null: the run's own."""

    mode: Literal["none", "central", "local"] = "none"
    clip: float = _f(1.0, gt=0)
    noise_multiplier: float | Literal["auto"] = _f(1.0, ge=0)
    delta: float = _f(1e-5, gt=0, lt=1)
    target_epsilon: float | None = _f(None, gt=0)
    max_epsilon: float | None = _f(None, gt=0)
    accountant: Literal["pld", "rdp", "prv"] = "pld"
    neighbours: Literal["add_remove", "replace_one"] = "add_remove"
    accounting_population: int | None = _f(None, ge=1)
    accounting_cohort: int | None = _f(None, ge=1)
    adaptive_clip: AdaptiveClipConfig = field(default_factory=AdaptiveClipConfig)
    # dp_fedavg: fresh noise each round; tree | bandmf: noise correlated across rounds
    # (DP-FTRL, fedloom.ftrl; central mode), its participation and matrix in `ftrl`
    mechanism: Literal["dp_fedavg", "tree", "bandmf"] = "dp_fedavg"
    ftrl: FtrlConfig = field(default_factory=FtrlConfig)


# The sections written ``{name, options}`` (and the backend), by dotted path: a string
# there is short for ``{name: STRING}`` (``feedback: sapef``, ``--set server.optimizer=adam``).
SHORTHAND_SECTIONS = ("backend", "model", "client.method", "server.optimizer",
                      "compression.feedback", "compression.adaptive", "cohort.selection",
                      "data.partition")


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

