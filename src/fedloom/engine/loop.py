"""The round loop.

One round, in order (DESIGN.md): sample the cohort → gather its per-client
state → train the cohort (backend) → uplink: encode → decode and stack →
reject non-finite rows (reported) → aggregate → server optimizer step →
scatter per-client state back → evaluate (on schedule) → log → checkpoint (on
schedule). The engine holds no math; each step is one call.

:func:`run` is the entry point of both the CLI and notebooks.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from fedloom.aggregate.base import CohortInfo, make_aggregator
from fedloom.aggregate.server_opt import ServerOptimizer
from fedloom.attack import make_attack
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD, lr_at_round
from fedloom.compress import coordinates_sent, make_compressor
from fedloom.compress.feedback import UplinkContext, UplinkResult, make_feedback
from fedloom.compress.identity import Identity
from fedloom.config import Config, ConfigError, config_to_dict, load_config
from fedloom.data.federated import FederatedData, build_federated
from fedloom.data.sources import Dataset, load_dataset
from fedloom.engine.checkpoint import (
    atomic_write_bytes,
    atomic_write_json,
    load_checkpoint,
    save_checkpoint,
)
from fedloom.metrics import accuracy_stats, conflict_rate, evaluate, evaluate_clients
from fedloom.models import build_model
from fedloom.params import Layout
from fedloom.registry import build, get
from fedloom.rng import Purpose, derive_seed, numpy_gen, torch_gen
from fedloom.state import ClientStateStore

__all__ = ["Experiment", "Result", "RunState", "model_sha256", "run"]

log = logging.getLogger("fedloom")

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_NO_DATA = torch.empty(0)


def _check_output(module: torch.nn.Module, x: torch.Tensor, num_classes: int) -> None:
    try:
        with torch.no_grad():
            out = module(x)
    except Exception as e:  # the user's forward failed on one sample of the data
        raise ValueError(f"model: forward on one sample of shape {tuple(x.shape[1:])} failed: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                         ) from None
    if out.ndim != 2 or out.shape[1] != num_classes:
        raise ValueError(f"model: outputs shape {tuple(out.shape[1:])} per sample, the data has "
                         f"{num_classes} classes")


def _finite_rows(rows: torch.Tensor) -> torch.Tensor:
    """Which rows hold only finite numbers. A row sum is NaN or ±inf when the row
    holds one (one pass, no m × d mask); only rows whose sum is not finite — a
    non-finite entry or a finite overflow — are checked entry by entry."""
    ok = torch.isfinite(rows.sum(dim=1))
    for i in (~ok).nonzero().flatten().tolist():
        ok[i] = bool(torch.isfinite(rows[i]).all())
    return ok


def model_sha256(w: torch.Tensor) -> str:
    """SHA-256 of the flat parameter vector's bytes (its own dtype, C order)."""
    return hashlib.sha256(w.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


@dataclass
class RunState:
    """Everything a round changes; a checkpoint is this plus the state store."""

    next_round: int
    w: torch.Tensor
    opt_state: dict[str, torch.Tensor]
    agg_state: Any
    method_state: dict[str, torch.Tensor] = field(default_factory=dict)
    feedback_state: dict[str, Any] = field(default_factory=dict)  # SA-PEF's L̂, SCAFCOM's c
    w_avg: torch.Tensor | None = None  # running mean of the iterates (eval.average_iterates)
    totals: dict[str, int] = field(
        default_factory=lambda: {"uplink_bytes": 0, "downlink_bytes": 0, "rejected_updates": 0}
    )


@dataclass
class RoundPlan:
    """A round's cohort and jobs, and what the server keeps of them until the end."""

    round: int
    cohort: torch.Tensor
    lr: float
    jobs: list[ClientJob]
    alphas: list[float]
    fb_rows: list[dict[str, torch.Tensor]]
    old_rows: dict[str, torch.Tensor]
    comp: Any
    ffl: dict[str, float]
    mismatch: list[tuple[float, float, float, int]]
    dropped: list[int] = field(default_factory=list)

    def keep(self, kept: Sequence[int]) -> None:
        """Keep the cohort positions ``kept``; the others are dropped clients."""
        if len(kept) == len(self.cohort):
            return
        pos = torch.tensor(kept, dtype=torch.long)
        gone = sorted(set(range(len(self.cohort))) - set(kept))
        self.dropped = [int(self.cohort[i]) for i in gone]
        self.cohort = self.cohort[pos]
        self.old_rows = {f: v[pos] for f, v in self.old_rows.items()}
        self.alphas = [self.alphas[i] for i in kept]
        self.fb_rows = [self.fb_rows[i] for i in kept]


@dataclass
class Result:
    """What :func:`run` returns."""

    config: Config
    w: torch.Tensor
    layout: Layout
    model: torch.nn.Module
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    run_dir: Path | None


class Experiment:
    """A config turned into typed objects: data, model, trainer, aggregator, server.

    Building it validates everything that needs the data or the model (e.g. an
    aggregator option), so a bad run fails before any file is written.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        state_dir: Path | None = None,
        data: Dataset | None = None,
        model: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
    ) -> None:
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        ds = data if data is not None else load_dataset(cfg.data, cfg.seed)
        self.fed: FederatedData = build_federated(ds, cfg.data, cfg.seed)
        if cfg.cohort.size > self.fed.num_clients:
            raise ConfigError(f"cohort.size: must be <= the number of clients "
                              f"({self.fed.num_clients}), got {cfg.cohort.size}")
        ds = self.fed.dataset
        # Index inputs (characters) stay integers; features take the run's dtype.
        self.x = ds.x.to(self.dtype) if ds.x.is_floating_point() else ds.x
        self.y = ds.y
        try:
            if model is None:
                self.module = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.seed,
                                          self.dtype)
            else:
                user = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model()
                if not isinstance(user, torch.nn.Module):
                    raise ValueError("model: the factory must return a torch.nn.Module")
                self.module = user.to(self.dtype)
                _check_output(self.module, self.x[:1], ds.num_classes)
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        self.module.eval()  # no dropout / batch statistics: training is functional
        self.layout = Layout.from_module(self.module)
        c = cfg.client
        self.trainer = LocalSGD(
            self.module, self.layout, batch_size=c.batch_size, epochs=c.epochs, steps=c.steps,
            momentum=c.momentum, weight_decay=c.weight_decay, prox_mu=c.prox_mu,
        )
        try:
            self.aggregator = make_aggregator(cfg.aggregator.name, **cfg.aggregator.options)
            self.method = build("method", c.method, c.method_options, "client.method_options")
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        if getattr(self.aggregator, "full_participation", False) and (
            cfg.cohort.size != self.fed.num_clients
        ):
            raise ConfigError(
                f"cohort.size: {cfg.aggregator.name} needs every client in every round; set "
                f"cohort.size={self.fed.num_clients}"
            )
        self.backend = get("backend", cfg.backend.name)(self.trainer, self.method, cfg.backend,
                                                        self.x, self.y)
        s = cfg.server
        self.server = ServerOptimizer(s.optimizer, lr=s.lr, momentum=s.momentum,
                                      beta1=s.beta1, beta2=s.beta2, eps=s.eps)
        self.requires = frozenset(getattr(self.aggregator, "requires", frozenset()))
        comp = cfg.compression
        try:
            self.uplink = make_compressor(comp.name, layout=self.layout, **comp.options)
            self.feedback = make_feedback(comp.feedback, comp.alpha, comp.alpha_schedule,
                                          comp.period, comp.reset_ratio, comp.beta,
                                          self.layout, comp.tau, comp.tau_decay,
                                          comp.penalty_steps, comp.penalty, comp.ef21_mean)
            # Byzantine clients (attack.*), for robustness experiments; None when off.
            self.attack = make_attack(cfg.attack, cfg.seed, self.fed.num_clients)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        self.downlink = Identity()
        # The dense broadcast's size depends on d only: measure it once, not every round.
        self.downlink_size = len(self.downlink.encode(torch.zeros(self.layout.size)))
        method_fields = self.method.fields(self.layout.size)
        fb_fields = {f"fb.{k}": v for k, v in self.feedback.fields(self.layout.size).items()}
        if set(method_fields) & set(fb_fields):  # pragma: no cover (prefix keeps them apart)
            raise ConfigError("client.method and compression.feedback share a state field")
        self.method_fields = list(method_fields)
        self.fb_fields = list(fb_fields)
        self.store = ClientStateStore(
            self.fed.num_clients, {**method_fields, **fb_fields},
            storage=cfg.state.storage, dtype=cfg.state.dtype, directory=state_dir,
            memmap_above_mb=cfg.state.memmap_above_mb,
            compute_dtype=self.dtype,
        )
        self.n_train = torch.from_numpy(self.fed.num_train())
        # All clients' test samples in one tensor, with the owner of each, so the
        # per-client evaluation is one pass of the model.
        test_idx = [t for t in self.fed.test]
        self.client_test_idx = torch.from_numpy(np.concatenate(test_idx)).long()
        self.client_test_owner = torch.from_numpy(
            np.concatenate([np.full(len(t), k) for k, t in enumerate(test_idx)])
        ).long()
        xt = self.fed.x_test
        self.x_test = xt.to(self.dtype) if xt.is_floating_point() else xt
        self.y_test = self.fed.y_test
        # per-client accuracies of the last evaluation (written to client_acc.json)
        self.last_client_acc: np.ndarray | None = None
        self.last_personal_acc: np.ndarray | None = None

    # ------------------------------------------------------------------ rounds
    def initial_state(self) -> RunState:
        w = self.layout.flatten(self.module).to(self.dtype)
        return RunState(0, w, self.server.init(w), self.aggregator.init(self.layout),
                        method_state=self.method.init_server(w),
                        feedback_state=self.feedback.init_server(w),
                        w_avg=w.clone() if self.cfg.eval.average_iterates else None)

    def sample_cohort(self, r: int) -> torch.Tensor:
        """``cohort.size`` distinct clients, uniformly, from the round's own generator."""
        gen = numpy_gen(self.cfg.seed, r, -1, Purpose.COHORT)
        ids = gen.choice(self.fed.num_clients, self.cfg.cohort.size, replace=False)
        return torch.from_numpy(np.sort(ids)).long()

    def lr(self, r: int) -> float:
        return lr_at_round(self.cfg.client.lr, self.cfg.client.schedule, r, self.cfg.rounds)

    def round(self, st: RunState) -> tuple[RunState, dict[str, Any]]:
        """Run round ``st.next_round``; return the new state and its metrics."""
        t0 = time.perf_counter()
        plan = self.plan_round(st)
        raw = self.backend.train_cohort(plan.jobs)
        t_train = time.perf_counter() - t0
        results, ups = self.uplink_round(st, plan, raw)
        return self.finish_round(st, plan, results, ups, t0=t0, t_train=t_train)

    def plan_round(self, st: RunState) -> RoundPlan:
        """The round's cohort and fully specified client jobs (the client state rows
        they need are gathered from the store)."""
        r = st.next_round
        cohort = self.sample_cohort(r)
        lr = self.lr(r)
        w = st.w
        old_rows = {f: self.store.gather(f, cohort) for f in self.store.fields}
        fb = self.feedback
        theory = fb.schedule == "theory"
        comp, epochs, ffl = self.uplink, None, {}
        if self.cfg.compression.adaptive == "ffl":
            comp, epochs, ffl = self._ffl(w, st)
        jobs, alphas, fb_rows, steps = [], [], [], []
        ships = getattr(self.backend, "ships_indices", False)
        mismatch: list[tuple[float, float, float, int]] = []
        for i, k in enumerate(cohort.tolist()):
            idx = torch.from_numpy(self.fed.train[k])
            fb_state = {f[3:]: old_rows[f][i] for f in self.fb_fields}
            steps.append(self.trainer.num_steps(len(idx), epochs))
            alpha = fb.alpha(lr, steps[-1], st.feedback_state)
            if self.cfg.metrics.mismatch and "residual" in fb_state:
                mismatch.append(self._mismatch(w, fb_state["residual"], k, len(idx)))
            # A backend that ships sample positions gathers the samples where it
            # trains: no copy of the cohort's data here.
            xk, yk = (_NO_DATA, _NO_DATA) if ships else (self.x[idx], self.y[idx])
            job = ClientJob(k, r, w, lr, xk, yk,
                            derive_seed(self.cfg.seed, r, k, Purpose.BATCH),
                            start_loss="start_losses" in self.requires,
                            state={f: old_rows[f][i] for f in self.method_fields},
                            start=fb.start_point(w, fb_state, alpha),
                            grad_shift=fb.grad_shift(fb_state, st.feedback_state),
                            penalty=fb.penalty(w, fb_state, r), epochs=epochs,
                            probe_smoothness=theory, data_index=idx)
            jobs.append(self.method.prepare(job, st.method_state))
            alphas.append(alpha)
            fb_rows.append(fb_state)
        return RoundPlan(r, cohort, lr, jobs, alphas, fb_rows, old_rows, comp, ffl, mismatch)

    def uplink_round(self, st: RunState, plan: RoundPlan, raw: Sequence[ClientResult | None]
                     ) -> tuple[list[ClientResult], list[UplinkResult]]:
        """Drop the clients whose training failed (``None``), then run each kept
        client's feedback policy and compressor: what it sends and its new state."""
        r, fb = plan.round, self.feedback
        # A client whose worker died (backend.on_failure=drop) is dropped for the
        # round: nothing of it is aggregated and its state rows stay as they were.
        plan.keep([i for i, res in enumerate(raw) if res is not None])
        if plan.dropped:
            log.warning("round %d: dropped clients %s (their worker failed)", r + 1,
                        plan.dropped)
        results = [res for res in raw if res is not None]
        if self.attack is not None:  # an attacker sends its transform of the update
            for res in results:
                res.update = self.attack(res.update, res.client, r)

        # Uplink: feedback + compressor; the server sees decode(payload), as bytes.
        ups = []
        for i, res in enumerate(results):
            ctx = UplinkContext(r, plan.lr, res.steps, plan.alphas[i],
                                torch_gen(self.cfg.seed, r, res.client, Purpose.COMPRESS),
                                self.cfg.client.momentum, len(results), self.fed.num_clients)
            ups.append(fb.uplink(res.update, plan.fb_rows[i], plan.comp, ctx,
                                 st.feedback_state))
            # The dense update is not needed past its uplink: free it now, so a
            # round holds one m × d copy less at its peak.
            res.update = res.update.new_empty(0)
        return results, ups

    def finish_round(self, st: RunState, plan: RoundPlan, results: Sequence[ClientResult],
                     ups: Sequence[UplinkResult], *, t0: float, t_train: float,
                     client_state: bool = True) -> tuple[RunState, dict[str, Any]]:
        """The server's half of a round, from what the kept clients sent: reject
        non-finite rows, aggregate, step, scatter client state (unless the
        clients keep it themselves: ``client_state=False``), evaluate, log."""
        r, cohort, lr, w = plan.round, plan.cohort, plan.lr, st.w
        fb, alphas, fb_rows, old_rows = self.feedback, plan.alphas, plan.fb_rows, plan.old_rows
        ffl, mismatch, dropped = plan.ffl, plan.mismatch, plan.dropped
        down_bytes = self.downlink_size * len(plan.jobs)
        up_bytes = sum(len(u.payload) + sum(len(x) for x in u.extra_payloads) for u in ups)
        density = (float(np.mean([coordinates_sent(u.payload) for u in ups])) / self.layout.size
                   if ups else float("nan"))
        row_list = [fb.server_row(u, fb_rows[i], st.feedback_state) for i, u in enumerate(ups)]
        rows = (torch.stack(row_list) if row_list
                else torch.empty((0, self.layout.size))).to(self.dtype)
        finite = _finite_rows(rows)
        for i, res in enumerate(results):  # a non-finite state row is rejected too
            states = [*res.state.values(), *ups[i].state.values()]
            if any(not bool(_finite_rows(v.reshape(1, -1))[0]) for v in states):
                finite[i] = False
        rejected = [int(c) for c, ok in zip(cohort.tolist(), finite.tolist(), strict=True)
                    if not ok]
        if rejected:
            log.warning("round %d: rejected non-finite updates from clients %s", r + 1, rejected)
        weights = torch.tensor([res.num_samples for res in results], dtype=self.dtype).reshape(-1)
        losses = torch.tensor([res.loss for res in results], dtype=torch.float64)

        t1 = time.perf_counter()
        agg_metrics: dict[str, Any] = {}
        new_w, opt_state, agg_state = w, st.opt_state, st.agg_state
        conflicts = 0.0
        if bool(finite.any()):
            # boolean indexing copies m × d: only when some row was rejected
            ok = finite if not bool(finite.all()) else slice(None)
            start = None
            if "start_losses" in self.requires:
                start = torch.tensor([res.start_loss for res in results], dtype=torch.float64)[ok]
            info = CohortInfo(
                clients=cohort[ok], round=r, num_clients=self.fed.num_clients,
                losses=losses[ok], steps=torch.tensor([res.steps for res in results])[ok], lr=lr,
                momentum=self.cfg.client.momentum, start_losses=start,
            )
            agg, agg_state, agg_metrics = self.aggregator(rows[ok], weights[ok], st.agg_state,
                                                          info=info)
            conflicts = conflict_rate(rows[ok], agg)
            new_w, opt_state = self.server.step(w, agg, st.opt_state)
        ok_list = finite.tolist()
        probes = [res.extra["smoothness"] for res, ok in zip(results, ok_list, strict=True)
                  if ok and "smoothness" in res.extra]
        end = fb.end_round([u for u, ok in zip(ups, ok_list, strict=True) if ok],
                           st.feedback_state, self.fed.num_clients, probes)
        feedback_state = end.server
        if "ffl_loss0" in ffl:
            feedback_state = {**feedback_state, "ffl_loss0": ffl["ffl_loss0"]}
        if end.w_shift is not None:
            new_w = new_w - end.w_shift.to(new_w.dtype)
        down_bytes += end.downlink_bytes
        method_state = st.method_state
        if client_state and self.store.fields and bool(finite.any()):
            ok_pos = finite.nonzero().squeeze(1)
            ok_ids = cohort[ok_pos]
            new_rows = {f: torch.stack([results[i].state[f] for i in ok_pos.tolist()])
                        for f in self.method_fields}
            for f in self.fb_fields:
                new_rows[f] = torch.stack([ups[i].state[f[3:]] for i in ok_pos.tolist()])
            for f, rows_f in new_rows.items():
                self.store.scatter(f, ok_ids, rows_f)
            if self.method_fields:
                method_state = self.method.server_update(
                    st.method_state, {f: old_rows[f][ok_pos] for f in self.method_fields},
                    {f: new_rows[f] for f in self.method_fields}, self.fed.num_clients)
        t_agg = time.perf_counter() - t1
        w_avg = st.w_avg
        if w_avg is not None:  # mean of w_0 … w_{r+1}
            w_avg = w_avg + (new_w - w_avg) / (r + 2)

        totals = dict(st.totals)
        totals["uplink_bytes"] += up_bytes
        totals["downlink_bytes"] += down_bytes
        totals["rejected_updates"] += len(rejected)
        ok_loss = losses[finite & torch.isfinite(losses)]
        ok_w = weights[finite & torch.isfinite(losses)].double()
        train_loss = float((ok_loss * ok_w).sum() / ok_w.sum()) if ok_w.numel() else float("nan")
        metrics: dict[str, Any] = {
            "round": r + 1,
            "lr": lr,
            "cohort_size": len(plan.jobs),
            "train_loss": train_loss,
            "uplink_bytes": up_bytes,
            "downlink_bytes": down_bytes,
            "uplink_bytes_total": totals["uplink_bytes"],
            "downlink_bytes_total": totals["downlink_bytes"],
            "rejected_updates": len(rejected),
            "rejected_updates_total": totals["rejected_updates"],
            "dropped_clients": len(dropped),
            "conflict_rate": conflicts,
            "density": density,
            **{k: v for k, v in ffl.items() if k != "ffl_loss0"},
            **{k: float(v) for k, v in agg_metrics.items()},
        }
        if self.fb_fields:
            ok_list = finite.tolist()
            norms = [u.residual_norm for u, ok in zip(ups, ok_list, strict=True) if ok]
            metrics["residual_norm"] = float(np.mean(norms)) if norms else float("nan")
            metrics["alpha"] = float(np.mean(alphas))
            if "lipschitz" in feedback_state:
                metrics["lipschitz_estimate"] = feedback_state["lipschitz"]
        if mismatch:
            nk = np.array([m[3] for m in mismatch], dtype=float)
            for j, key in enumerate(("grad_mismatch", "residual_sq", "grad_sq")):
                metrics[key] = float(np.average([m[j] for m in mismatch], weights=nk))
        if rejected:
            metrics["rejected_clients"] = rejected
        if dropped:
            metrics["dropped_client_ids"] = dropped
        extras = [res.extra for res, ok in zip(results, finite.tolist(), strict=True) if ok]
        for key in sorted({k for e in extras for k in e}):
            metrics[key] = float(np.mean([e[key] for e in extras if key in e]))
        if (r + 1) % self.cfg.eval.every == 0 or r + 1 == self.cfg.rounds:
            metrics.update(self.evaluate(w_avg if w_avg is not None else new_w))
            if self.method.personal:
                metrics.update(self.evaluate_personal(new_w))
        metrics["train_s"] = t_train
        metrics["agg_s"] = t_agg
        metrics["wall_s"] = time.perf_counter() - t0
        return RunState(r + 1, new_w, opt_state, agg_state, method_state, feedback_state, w_avg,
                        totals), metrics

    def _ffl(self, w: torch.Tensor, st: RunState) -> tuple[Any, int, dict[str, float]]:
        """FFL's schedule from the global test loss: ``R_t = R (L_0/L_t)^(1/3)``,
        ``E_t = max(1, round(E (L_t/L_0)^(1/3)))`` (Nori et al. 2021, as in FLARE)."""
        _, loss = evaluate(self.module, self.layout, w, self.x_test, self.y_test,
                           self.cfg.eval.batch_size)
        loss0 = float(st.feedback_state.get("ffl_loss0", loss))
        ratio0 = float(self.cfg.compression.options.get("ratio", 0.01))
        ratio = min(1.0, ratio0 * (loss0 / loss) ** (1 / 3))
        epochs = max(1, round(self.cfg.client.epochs * (loss / loss0) ** (1 / 3)))
        opts = {**self.cfg.compression.options, "ratio": ratio}
        comp = make_compressor(self.cfg.compression.name, layout=self.layout, **opts)
        return comp, epochs, {"ffl_loss0": loss0, "ffl_ratio": ratio, "ffl_epochs": epochs}

    def _mismatch(self, w: torch.Tensor, e: torch.Tensor, k: int,
                  n: int) -> tuple[float, float, float, int]:
        """SA-PEF's diagnostic on the first batch of client k's validation split:
        ``‖∇f(w) − ∇f(w − α_p e_k)‖²``, ``‖e_k‖²``, ``‖∇f(w)‖²``."""
        val = self.fed.test[k] if len(self.fed.test[k]) else self.fed.train[k]
        idx = torch.from_numpy(val[: self.cfg.client.batch_size])
        xb, yb = self.x[idx], self.y[idx]
        g0 = self.trainer.grad(w, xb, yb)
        g1 = self.trainer.grad(w - self.cfg.metrics.mismatch_alpha * e, xb, yb)
        return (float(((g0 - g1) ** 2).sum()), float((e * e).sum()), float((g0 * g0).sum()), n)

    def evaluate(self, w: torch.Tensor) -> dict[str, float]:
        """Global test accuracy/loss and per-client accuracy statistics of ``w``."""
        bs = self.cfg.eval.batch_size
        acc, loss = evaluate(self.module, self.layout, w, self.x_test, self.y_test, bs)
        out = {"test_acc": acc, "test_loss": loss}
        if self.client_test_idx.numel():
            per_client = evaluate_clients(
                self.module, self.layout, w, self.x[self.client_test_idx],
                self.y[self.client_test_idx], self.client_test_owner, self.fed.num_clients, bs,
            )
            out.update(accuracy_stats(per_client))
            self.last_client_acc = per_client
        return out

    def evaluate_personal(self, w: torch.Tensor, chunk: int = 64) -> dict[str, float]:
        """Per-client accuracy of the personal models (``w`` where none exists yet)."""
        acc = np.full(self.fed.num_clients, np.nan)
        bs = self.cfg.eval.batch_size
        for s in range(0, self.fed.num_clients, chunk):
            ids = list(range(s, min(s + chunk, self.fed.num_clients)))
            models = self.store.gather("personal", ids)
            have = self.store.gather("personal_set", ids)[:, 0] > 0
            for j, k in enumerate(ids):
                te = self.fed.test[k]
                if len(te) == 0:
                    continue
                v = models[j] if bool(have[j]) else w
                idx = torch.from_numpy(te)
                acc[k], _ = evaluate(self.module, self.layout, v, self.x[idx], self.y[idx], bs)
        self.last_personal_acc = acc
        return accuracy_stats(acc, prefix="personal_acc")

    def close(self) -> None:
        """Stop the backend's workers, if it has any."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------- checkpoints
    def checkpoint_state(self, st: RunState, snapshot_dir: Path | None = None
                         ) -> dict[str, Any]:
        """The checkpoint of ``st``; memmap state fields are copied to files in
        ``snapshot_dir`` (tagged with the round) instead of into the dict."""
        return {
            "format": 1,
            "next_round": st.next_round,
            "w": st.w,
            "opt_state": st.opt_state,
            "agg_state": st.agg_state,
            "method_state": st.method_state,
            "feedback_state": st.feedback_state,
            "w_avg": st.w_avg,
            "totals": st.totals,
            "store": self.store.state_dict(snapshot_dir, tag=f"r{st.next_round}"),
            "config": config_to_dict(self.cfg),
        }

    def restore(self, ckpt: dict[str, Any], snapshot_dir: Path | None = None) -> RunState:
        self.store.load_state_dict(ckpt["store"], snapshot_dir)
        return RunState(ckpt["next_round"], ckpt["w"], ckpt["opt_state"], ckpt["agg_state"],
                        ckpt["method_state"], ckpt["feedback_state"], ckpt["w_avg"],
                        dict(ckpt["totals"]))


# ---------------------------------------------------------------------- run dir
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINT_FILE = "checkpoints/last.pt"
MODEL_FILE = "model.pt"
CLIENT_ACC_FILE = "client_acc.json"

Callback = Callable[[RunState, dict[str, Any]], None]


def _read_metrics(path: Path, before_round: int) -> list[dict[str, Any]]:
    """Lines of a metrics file with ``round <= before_round`` (a torn last line is dropped)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            break
        if obj.get("round", 0) <= before_round:
            out.append(obj)
    return out


def _summary(exp: Experiment, st: RunState, history: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"rounds": st.next_round, "model_sha256": model_sha256(st.w),
                               "num_parameters": exp.layout.size,
                               "backend": getattr(exp.backend, "name", exp.cfg.backend.name)}
    for m in history:  # final value of each metric (eval metrics from the last eval round)
        summary.update({k: v for k, v in m.items()
                        if k not in ("rejected_clients", "dropped_client_ids")})
    summary["rejected_updates_total"] = st.totals["rejected_updates"]
    summary["wall_s_total"] = float(sum(m.get("wall_s", 0.0) for m in history))
    return summary


def run(
    config: str | Path | dict[str, Any] | Config,
    overrides: Sequence[str] = (),
    *,
    out: str | Path | None = None,
    resume: bool = False,
    callbacks: Sequence[Callback] = (),
    data: Dataset | None = None,
    model: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
) -> Result:
    """Run an experiment; return the final model, metrics and summary.

    Args:
        config: a YAML path, a mapping or a :class:`Config`.
        overrides: dotted ``key=value`` overrides.
        out: the run directory. ``None`` runs in memory (no files, no checkpoints).
            A directory that holds a run is never overwritten unless ``resume``.
        resume: continue from ``out``'s last checkpoint; the config must match
            the one saved there. The result is bit-identical to an uninterrupted run.
        callbacks: called as ``cb(state, metrics)`` after each round is logged
            and checkpointed.
        data: your own dataset (:func:`fedloom.data.from_arrays`) instead of ``data.name``.
        model: your own ``torch.nn.Module`` (its current weights are ``w_0``) or a
            factory returning one, instead of ``model.name``. Layer groups are
            derived from it, so CRAFT's per-layer mode works on it.
    """
    cfg = load_config(config, overrides)
    run_dir = Path(out) if out is not None else None
    resolved = config_to_dict(cfg)
    if run_dir is not None:
        saved = run_dir / CONFIG_FILE
        if resume:
            if saved.exists() and yaml.safe_load(saved.read_text()) != resolved:
                raise ConfigError(
                    f"{saved}: the config differs from the one given; resume needs the same "
                    "config and overrides"
                )
        elif run_dir.exists() and any(run_dir.iterdir()):
            raise ConfigError(f"{run_dir}: run directory exists and is not empty "
                              "(use --resume to continue it, or another --out)")
    created = run_dir is not None and not run_dir.exists()
    try:
        exp = Experiment(cfg, state_dir=(run_dir / "state") if run_dir is not None else None,
                         data=data, model=model)
        try:
            return _loop(exp, cfg, resolved, run_dir, resume, callbacks)
        finally:
            exp.close()
    except BaseException:
        # A run dir made by this call that holds no checkpoint has nothing worth
        # keeping; one with a checkpoint stays so that --resume can continue it.
        if created and run_dir is not None and not (run_dir / CHECKPOINT_FILE).exists():
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _save(path: Path, state: dict[str, Any]) -> None:
    """Write the checkpoint, then drop the state snapshot files it no longer names
    (the new snapshot files were complete before the checkpoint named them)."""
    save_checkpoint(path, state)
    keep = {v["file"] for v in state["store"].values() if isinstance(v, dict)}
    for f in path.parent.glob("state-*.bin"):
        if f.name not in keep:
            f.unlink(missing_ok=True)


def _loop(
    exp: Experiment, cfg: Config, resolved: dict[str, Any], run_dir: Path | None,
    resume: bool, callbacks: Sequence[Callback],
) -> Result:
    st = exp.initial_state()
    history: list[dict[str, Any]] = []
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt_path = run_dir / CHECKPOINT_FILE
        if resume and ckpt_path.exists():
            st = exp.restore(load_checkpoint(ckpt_path), ckpt_path.parent)
        history = _read_metrics(run_dir / METRICS_FILE, st.next_round) if resume else []
        atomic_write_bytes(run_dir / CONFIG_FILE,
                           yaml.safe_dump(resolved, sort_keys=False).encode())
        # Rewrite the metrics file to the rounds the state reflects (drops rounds
        # run after the last checkpoint by a killed run; they are run again).
        atomic_write_bytes(run_dir / METRICS_FILE,
                           "".join(json.dumps(m) + "\n" for m in history).encode())
    metrics_f = open(run_dir / METRICS_FILE, "a") if run_dir is not None else None
    try:
        while st.next_round < cfg.rounds:
            st, m = exp.round(st)
            history.append(m)
            if metrics_f is not None:
                metrics_f.write(json.dumps(m) + "\n")
                metrics_f.flush()
            if (run_dir is not None and cfg.checkpoint.every
                    and (st.next_round % cfg.checkpoint.every == 0 or st.next_round == cfg.rounds)):
                _save(run_dir / CHECKPOINT_FILE, exp.checkpoint_state(
                    st, (run_dir / CHECKPOINT_FILE).parent))
            for cb in callbacks:
                cb(st, m)
    finally:
        if metrics_f is not None:
            metrics_f.close()
    exp.layout.load_into(exp.module, st.w)
    summary = _summary(exp, st, history)
    if run_dir is not None:
        import io

        buf = io.BytesIO()
        torch.save({"state_dict": exp.module.state_dict(), "w": st.w,
                    "names": exp.layout.names}, buf)
        atomic_write_bytes(run_dir / MODEL_FILE, buf.getvalue())
        atomic_write_json(run_dir / SUMMARY_FILE, summary)
        per_client = {name: [None if np.isnan(a) else float(a) for a in arr]
                      for name, arr in (("client_acc", exp.last_client_acc),
                                        ("personal_acc", exp.last_personal_acc))
                      if arr is not None}
        atomic_write_json(run_dir / CLIENT_ACC_FILE, per_client)
        from fedloom.report.plots import write_run_plots

        write_run_plots(run_dir, history)
    return Result(cfg, st.w, exp.layout, exp.module, history, summary, run_dir)
