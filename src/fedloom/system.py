"""Systems heterogeneity: simulated devices, links, deadlines and availability.

Each client ``k`` has a device: a compute speed ``v_k`` (samples/s), an uplink and a
downlink bandwidth ``b↑_k``, ``b↓_k`` (bit/s) and a one-way latency ``ℓ_k`` (s, per
message). A round costs client ``k``, in simulated seconds,

    t_k = ℓ_k + 8·B↓/b↓_k + n_k/v_k + ℓ_k + 8·B↑_k/b↑_k,

with ``B↓``, ``B↑_k`` the bytes the engine counts and ``n_k`` the samples its local
steps processed. The model is the one of FL system simulators (FedScale, Lai et al.,
ICML 2022; FLASH, Yang et al., WWW 2021). Checked against FedScale's public
``ClientMetadata.get_completion_time`` (github.com/SymbioticLab/FedScale,
``fedscale/cloud/internal/client_metadata.py``): with ``v = 1000/(3c)``, equal up/down
bandwidths and no latency the two agree exactly when ``N_k`` is a multiple of ``B``
(``tests/test_system.py``); departures: an epoch's short last batch counts the samples
it holds, each direction has its own bandwidth, a latency per message, a device keeps
its speed for the whole run.

Devices (``system.profile``) are drawn once per client from ``(seed, -1, k, "system")``;
a round lasts until its slowest used client reports, or until ``system.deadline_s``;
late clients are dropped or (``late: partial``) run the steps that fit; availability
and dropout are drawn per round and client. Departures: Ditto's personal model and a
smoothness probe are not timed; SA-PEF's ``alpha_schedule: theory`` is planned with the
full step count; the Flower integration takes availability only.
Each part in full: docs/howto/systems.md (The time model in detail).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import numpy as np
import torch

from fedloom.config import SYSTEM_QUANTITIES as QUANTITIES
from fedloom.config import ConfigError, SystemConfig, check_system_config, system_values
from fedloom.rng import Purpose, derive_seed, numpy_gen, torch_gen

if TYPE_CHECKING:
    from fedloom.compress.feedback import UplinkResult
    from fedloom.job import ClientJob, ClientResult


class RoundPlan(Protocol):
    """What the system model reads of a round's plan
    (:class:`fedloom.engine.runstate.RoundPlan`, a frozen dataclass: the plan with
    cut step budgets is a copy, ``dataclasses.replace``)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def round(self) -> int: ...
    @property
    def jobs(self) -> list[ClientJob]: ...
    @property
    def comp(self) -> Any: ...


class Clients(Protocol):
    """What the system model reads of the clients: their training splits
    (:class:`fedloom.engine.inputs.ClientData`: ``fed.train[k]``)."""

    @property
    def fed(self) -> Any: ...


class RunState(Protocol):
    """The run state's simulated clock (:class:`fedloom.engine.runstate.RunState`)."""

    # a dataclass: finish() replaces its clock with dataclasses.replace
    __dataclass_fields__: ClassVar[dict[str, Any]]
    sim_time_s: float


# finish() gives back the state it was given, with the clock advanced
_State = TypeVar("_State", bound=RunState)
# begin() gives back the plan it was given, its cut clients' jobs replaced
_Plan = TypeVar("_Plan", bound=RoundPlan)

__all__ = ["Device", "RoundSim", "System", "check_system_config", "client_time",
           "make_system", "read_devices", "samples_for_steps", "steps_within"]

CSV_COLUMNS = ("client", "speed", "up_bps", "down_bps", "latency")


@dataclass(frozen=True)
class Device:
    """One client's simulated device and links (0: that term takes no time)."""

    speed: float      # samples/s
    up_bps: float     # bit/s
    down_bps: float   # bit/s
    latency_s: float  # s, per message each way


def transfer_s(nbytes: int, bps: float) -> float:
    """Seconds to send ``nbytes`` at ``bps`` bit/s (0 when the link is not modelled)."""
    return nbytes * 8 / bps if bps > 0 else 0.0


def compute_s(samples: int, speed: float) -> float:
    """Seconds to process ``samples`` at ``speed`` samples/s (0 when not modelled)."""
    return samples / speed if speed > 0 else 0.0


def client_time(dev: Device, down_bytes: int, samples: int, up_bytes: int) -> float:
    """``t_k = ℓ + 8·B↓/b↓ + n/v + ℓ + 8·B↑/b↑`` (summed in this order)."""
    return (dev.latency_s + transfer_s(down_bytes, dev.down_bps) + compute_s(samples, dev.speed)
            + dev.latency_s + transfer_s(up_bytes, dev.up_bps))


def samples_for_steps(steps: int, n: int, batch: int) -> int:
    """Samples processed by ``steps`` local steps of batch ``batch`` over ``n`` samples:
    ``e·n + j·batch`` with ``e, j = divmod(steps, ⌈n/batch⌉)`` (an epoch's last batch
    holds the remainder, as :meth:`fedloom.client.sgd.LocalSGD.batch_indices` draws)."""
    per = max(1, math.ceil(n / batch))
    e, j = divmod(int(steps), per)
    return e * n + j * batch


def steps_within(samples: float, n: int, batch: int, full: int) -> int:
    """The most steps, at most ``full``, whose :func:`samples_for_steps` is ``≤ samples``."""
    if samples == math.inf:
        return full
    budget = max(0, math.floor(samples))
    per = max(1, math.ceil(n / batch))
    e, rest = divmod(budget, max(1, n))
    # rest < n, so rest // batch ≤ per − 1: a partial epoch's batches are all full ones
    return min(full, e * per + rest // batch)


def _uniform(seed: int, r: int, k: int, purpose: str) -> float:
    """One uniform in [0, 1) of the stream ``(seed, r, k, purpose)``: its derived seed
    (63 bits of BLAKE2b) scaled down. A per-client coin needs no generator object,
    which costs about 50 µs to build: ``num_clients`` of them a round add up."""
    return derive_seed(seed, r, k, purpose) / float(1 << 63)


def read_devices(path: str | Path, num_clients: int) -> dict[int, Device]:
    """The devices of a CSV file with the header ``client,speed,up_bps,down_bps,latency``
    (any column order), one row per client ``0 … num_clients − 1``. Raises
    :class:`ConfigError` naming the file (and line) for anything else."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise ConfigError(f"system.path: {p}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"system.path: {p}: is a directory") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"system.path: {p}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"system.path: {p}: cannot be read ({e.strerror or e})") from None
    reader = csv.reader(io.StringIO(text))
    header = [h.strip() for h in next(reader, [])]
    if sorted(header) != sorted(CSV_COLUMNS):
        raise ConfigError(f"{p}: the header must name the columns {','.join(CSV_COLUMNS)}, "
                          f"got {','.join(header) or 'nothing'}")
    col = {h: i for i, h in enumerate(header)}
    out: dict[int, Device] = {}
    for line, row in enumerate(reader, 2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise ConfigError(f"{p}: line {line}: {len(row)} fields, expected {len(header)}")
        try:
            k = int(row[col["client"]])
            vals = [float(row[col[c]]) for c in CSV_COLUMNS[1:]]
        except ValueError:
            raise ConfigError(f"{p}: line {line}: not a number") from None
        if not 0 <= k < num_clients:
            raise ConfigError(f"{p}: line {line}: client {k} is not a client of this run "
                              f"(0 … {num_clients - 1})")
        if k in out:
            raise ConfigError(f"{p}: line {line}: client {k} appears twice")
        if not all(math.isfinite(v) and v >= 0 for v in vals):
            raise ConfigError(f"{p}: line {line}: speed, bandwidths and latency must be "
                              "finite and >= 0")
        out[k] = Device(*vals)
    missing = [k for k in range(num_clients) if k not in out]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConfigError(f"{p}: no row for clients {missing[:5]}{more}")
    return out


# ------------------------------------------------------------------------ rounds
@dataclass
class RoundSim:
    """What the system model decided and measured in one round (client ids as keys)."""

    round: int
    withheld: dict[int, str] = field(default_factory=dict)  # not trained: why
    cut: dict[int, int] = field(default_factory=dict)       # partial: the steps allowed
    late: list[int] = field(default_factory=list)
    times: dict[int, float] = field(default_factory=dict)   # t_k of the reporting clients
    round_s: float = 0.0
    steps: list[int] = field(default_factory=list)          # of the clients used
    cohort: int = 0                                         # clients drawn for the round

    def train(self, backend: Any, jobs: Sequence[Any]) -> list[ClientResult | None]:
        """Train the jobs that are not withheld; ``None`` (a dropped client) for the others."""
        todo = [i for i, j in enumerate(jobs) if j.client not in self.withheld]
        out: list[ClientResult | None] = [None] * len(jobs)
        if todo:
            for i, res in zip(todo, backend.train_cohort([jobs[i] for i in todo]), strict=True):
                out[i] = res
        return out


class System:
    """The run's devices, availability and round timing (settings only: a round's
    decisions live in its :class:`RoundSim`, the clock in ``RunState.sim_time_s``)."""

    def __init__(self, cfg: SystemConfig, seed: int, num_clients: int, batch_size: int,
                 cohort_size: int, *, poisson: bool = False) -> None:
        self.cfg = cfg
        self.seed = seed
        self.num_clients = num_clients
        self.batch = batch_size
        self.cohort_size = cohort_size
        # cohort.sampling: poisson (each available client at rate q; no size to fill)
        self.poisson = poisson
        self.timed = cfg.profile != "off"
        self.has_availability = cfg.availability < 1 or cfg.pattern != "none"
        self._devices: dict[int, Device] = (read_devices(cfg.path, num_clients)
                                            if cfg.profile == "csv" else {})
        self._available: dict[int, int] = {}  # round → clients available
        self._exp_comp: Any = None             # the compressor the estimate is of
        self._exp_bytes = 0

    # -------------------------------------------------------------- devices
    def device(self, k: int) -> Device:
        """Client ``k``'s device (drawn once, from ``(seed, -1, k, "system")``)."""
        dev = self._devices.get(k)
        if dev is None:
            dev = self._devices[k] = self._draw(k)
        return dev

    def _draw(self, k: int) -> Device:
        cfg = self.cfg
        gen = numpy_gen(self.seed, -1, k, Purpose.SYSTEM)
        if cfg.profile == "classes":
            probs = np.array([c.p for c in cfg.classes], dtype=np.float64)
            cum = np.cumsum(probs)
            i = int(np.searchsorted(cum, gen.random() * cum[-1], side="right"))
            c = cfg.classes[min(i, len(cfg.classes) - 1)]
            return Device(c.speed, c.up_bps, c.down_bps, c.latency_s)
        draws = gen.random(4) if cfg.profile == "uniform" else gen.standard_normal(4)
        vals = []
        for q, u in zip(QUANTITIES, draws, strict=True):
            v = system_values(cfg, q)
            if len(v) == 1:
                vals.append(v[0])
            elif cfg.profile == "uniform":
                vals.append(v[0] + (v[1] - v[0]) * float(u))
            else:  # lognormal: [median, sigma]
                vals.append(v[0] * math.exp(v[1] * float(u)))
        return Device(*vals)

    # --------------------------------------------------------- availability
    def p_available(self, r: int, k: int) -> float:
        """``p_k(r)``, the probability that client ``k`` can take part in round ``r``."""
        cfg = self.cfg
        p = cfg.availability
        if cfg.pattern == "none":
            return p
        phase = _uniform(self.seed, -1, k, Purpose.AVAILABILITY)
        x = r / cfg.period + phase
        if cfg.pattern == "sine":
            return min(1.0, max(0.0, p + cfg.amplitude * math.sin(2 * math.pi * x)))
        return p if x - math.floor(x) < cfg.on_fraction else 0.0

    def available(self, r: int) -> np.ndarray:
        """Which clients are available in round ``r`` (a bool per client)."""
        out = np.zeros(self.num_clients, dtype=bool)
        for k in range(self.num_clients):
            p = self.p_available(r, k)
            if p > 0:
                out[k] = _uniform(self.seed, r, k, Purpose.AVAILABILITY) < p
        return out

    def available_ids(self, r: int) -> np.ndarray:
        """The ids of the clients available in round ``r`` (sorted; their count is
        reported in the round's metrics)."""
        ids = np.flatnonzero(self.available(r)).astype(np.int64)
        self._available[r] = len(ids)
        return ids

    def sample(self, r: int, gen: np.random.Generator, size: int) -> torch.Tensor:
        """``size`` distinct available clients, uniformly (all when fewer are available)."""
        ids = self.available_ids(r)
        chosen = ids if len(ids) <= size else gen.choice(ids, size, replace=False)
        return torch.from_numpy(np.sort(chosen)).long()

    # -------------------------------------------------------------- a round
    def expected_uplink(self, comp: Any, d: int) -> int:
        """Bytes of ``comp``'s payload for a fixed Gaussian vector of size ``d``."""
        if comp is not self._exp_comp:
            g = torch_gen(self.seed, -1, -1, Purpose.SYSTEM)
            v = torch.randn(d, generator=g) * 1e-2
            self._exp_bytes = len(comp.encode(v, gen=torch_gen(self.seed, -1, -1,
                                                                Purpose.SYSTEM)))
            self._exp_comp = comp
        return self._exp_bytes

    def begin(self, plan: _Plan, clients: Clients, local: Any, d: int,
              downlink_size: int) -> tuple[_Plan, RoundSim]:
        """Decide the round's mid-round dropouts (``withheld``) and (``late:
        partial``) each client's step budget: the plan returned is ``plan`` whose
        cut clients' jobs have ``max_steps``. Reads the clients' training split
        sizes, the local update's step count (``local.num_steps``), the model's size
        ``d``, the broadcast's size and the round's compressor."""
        cfg, r = self.cfg, plan.round
        sim, jobs = RoundSim(r, cohort=len(plan.jobs)), list(plan.jobs)
        partial = self.timed and cfg.deadline_s is not None and cfg.late == "partial"
        up = self.expected_uplink(plan.comp, d) if partial else 0
        for i, job in enumerate(plan.jobs):
            k = job.client
            if cfg.dropout > 0 and _uniform(self.seed, r, k, Purpose.CLIENT_DROPOUT) < cfg.dropout:
                sim.withheld[k] = "dropped out mid-round (system.dropout)"
                continue
            if not partial:
                continue
            assert cfg.deadline_s is not None
            dev = self.device(k)
            n = len(clients.fed.train[k])
            full = local.num_steps(n, job.steps.epochs)
            left = (cfg.deadline_s - 2 * dev.latency_s - transfer_s(downlink_size, dev.down_bps)
                    - transfer_s(up, dev.up_bps))
            allowed = 0 if left < 0 else steps_within(
                left * dev.speed if dev.speed > 0 else math.inf, n, self.batch, full)
            if allowed == 0:
                sim.withheld[k] = "no local step fits before system.deadline_s"
            elif allowed < full:
                jobs[i] = job.cut(allowed)
                sim.cut[k] = allowed
        return (dataclasses.replace(plan, jobs=jobs) if sim.cut else plan), sim

    def after_uplink(self, sim: RoundSim, clients: Clients, downlink_size: int,
                     results: list[ClientResult], ups: list[UplinkResult]) -> list[int]:
        """Time each reporting client from its real payload; set the round's
        duration. Returns the positions of those past the deadline, to be withdrawn
        (not used, state untouched: :func:`fedloom.engine.runstate.withdraw`)."""
        gone: list[int] = []
        if self.timed:
            for res, up in zip(results, ups, strict=True):
                k = res.client
                nbytes = len(up.payload) + sum(len(x) for x in up.extra_payloads)
                samples = samples_for_steps(res.steps, len(clients.fed.train[k]), self.batch)
                sim.times[k] = client_time(self.device(k), downlink_size, samples, nbytes)
            dl = self.cfg.deadline_s
            if dl is not None:
                gone = [i for i, res in enumerate(results) if sim.times[res.client] > dl]
                if gone:
                    sim.late = [results[i].client for i in gone]
                    out = set(gone)
                    results = [res for i, res in enumerate(results) if i not in out]
            # A late client keeps the server waiting until the deadline.
            timed_out = bool(sim.late) or any("deadline" in w for w in sim.withheld.values())
            if timed_out and dl is not None:
                sim.round_s = dl
            else:
                sim.round_s = max((sim.times[res.client] for res in results), default=0.0)
        sim.steps = [res.steps for res in results]
        return gone

    def finish(self, sim: RoundSim, st: RunState, new: _State, metrics: dict[str, Any]
               ) -> tuple[_State, dict[str, Any]]:
        """Add the round's system metrics; advance the simulated clock."""
        r = sim.round
        if self.has_availability:
            avail = self._available.pop(r, self.num_clients)
            metrics["available_clients"] = avail
            # short: fewer available than cohort.size, so all were taken; under Poisson
            # sampling there is no size to fill (the cohort is random, q of the available
            # on average): short when nobody was drawn, a round with no one to train
            metrics["cohort_short"] = (int(sim.cohort == 0) if self.poisson
                                       else int(avail < self.cohort_size))
        if self.cfg.dropout > 0:
            metrics["dropout_clients"] = sum("dropout" in w for w in sim.withheld.values())
        if self.timed:
            clock = st.sim_time_s + sim.round_s
            new = dataclasses.replace(new, sim_time_s=clock)
            metrics["sim_round_s"] = sim.round_s
            metrics["sim_time_s"] = clock
            if self.cfg.deadline_s is not None:
                metrics["late_clients"] = len(sim.late) + sum(
                    "deadline" in w for w in sim.withheld.values())
                if self.cfg.late == "partial":
                    metrics["cut_clients"] = len(sim.cut)
            metrics["local_steps_mean"] = (float(np.mean(sim.steps)) if sim.steps
                                           else float("nan"))
        return new, metrics


def make_system(cfg: SystemConfig, seed: int, num_clients: int, batch_size: int,
                cohort_size: int, *, full_participation: bool = False,
                poisson: bool = False) -> System | None:
    """The run's :class:`System`, or ``None`` when the section is off (nothing is
    simulated and the engine takes its plain path); ``poisson``: cohort.sampling
    poisson."""
    check_system_config(cfg)
    sysm = System(cfg, seed, num_clients, batch_size, cohort_size, poisson=poisson)
    if not (sysm.timed or sysm.has_availability or cfg.dropout > 0):
        return None
    if sysm.has_availability and full_participation:
        raise ConfigError("system.availability: the aggregator needs every client in every "
                          "round; leave availability at 1 and pattern none")
    return sysm
