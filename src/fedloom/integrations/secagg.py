"""SecAgg+ on Flower: the server sees only the weighted sum of the clients' updates.

Flower's SecAgg+ (Bell et al., "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", CCS 2020) is a ``SecAggPlusWorkflow`` in the
ServerApp and the ``secaggplus_mod`` in the ClientApp, for Flower's strategy-based
("legacy") apps only: the workflow calls ``Strategy.configure_fit`` / ``aggregate_fit``,
passing every result the **unmasked weighted average** ``Σ_k ω_k x_k / Σ_k ω_k``
instead of the clients' own parameters. This module is that path for fedloom:

- :class:`SecAggStrategy` samples fedloom's cohort (the engine's generator),
  sends each sampled client the model and its round settings, and applies the
  unmasked average as the aggregate of fedloom's server optimizer step.
- :func:`secagg_client_app`: a ClientApp that trains with fedloom's local SGD
  on client ``k``'s data, applies ``privacy.mode=local`` and the compressor's round
  trip, and returns the dense update with ``ω_k = n_k`` (``fedavg``) or 1
  (``weighted: false``), which ``secaggplus_mod`` masks.

Scope: ``server.secure_aggregation: true`` with ``fedavg``, a linear compressor,
no error feedback, method ``sgd``, fixed-size cohorts, ``privacy.mode`` none, local
or central without adaptive clipping, and ``model.buffers: keep_global``; anything
else is one line.
Departure: the protocol clips each value to ``±clipping_range`` and rounds it
stochastically, so a run is not bit-for-bit reproducible: one round differs from
``fedloom run``'s by 6.2e-6 and 7.1e-6 max abs, under the bound 2.1e-5 (tests/test_flower.py).
The scope, the quantisation and the measurements in detail: docs/deploy.md (SecAgg+ in detail).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fedloom.config import Config, ConfigError, load_config
from fedloom.engine.experiment import Experiment
from fedloom.engine.runstate import RunState, model_sha256
from fedloom.integrations.flower.cache import _experiment
from fedloom.integrations.flower.discovery import discover_clients
from fedloom.integrations.flower.messages import HELLO_KEY, ConfigSource, _client_id
from fedloom.params import Layout
from fedloom.privacy import check_secure_aggregation, clip_update, make_privacy
from fedloom.rng import Purpose, derive_seed, torch_gen

try:
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import (
        EvaluateIns,
        FitIns,
        FitRes,
        Parameters,
        ndarrays_to_parameters,
        parameters_to_ndarrays,
    )
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.client_manager import ClientManager
    from flwr.server.client_proxy import ClientProxy
    from flwr.server.strategy import Strategy as LegacyStrategy
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.serverapp import Grid
except ImportError as e:  # pragma: no cover (the extra is missing)
    raise ImportError("fedloom.integrations.secagg needs Flower: pip install 'fedloom[flower]'"
                      ) from e

__all__ = ["SecAggStrategy", "secagg_client_app", "secagg_server_app"]


def check_secagg_scope(cfg: Config, aggregator: Any = None, compressor: Any = None) -> None:
    """One line naming the field of what this path does not run (module docstring);
    with the run's ``aggregator`` and ``compressor`` built, their declared
    capabilities too (:func:`~fedloom.privacy.check_secure_aggregation`)."""
    if not cfg.server.secure_aggregation:
        raise ConfigError("server.secure_aggregation: must be true for the SecAgg+ apps")
    if cfg.aggregator.name != "fedavg":
        raise ConfigError(f"aggregator.name: {cfg.aggregator.name} is not wired to SecAgg+ "
                          "(fedavg is)")
    if cfg.compression.feedback.name != "none":
        raise ConfigError("compression.feedback.name: only none with SecAgg+")
    if cfg.attack.fraction > 0:
        raise ConfigError("attack.fraction: Byzantine clients are simulated in-process "
                          "(fedloom run, any backend), not on the SecAgg+ apps")
    if cfg.client.method.name != "sgd":
        raise ConfigError(f"client.method.name: {cfg.client.method.name} is not wired to "
                          "SecAgg+ (sgd is)")
    if cfg.cohort.sampling != "fixed":
        raise ConfigError("cohort.sampling: poisson is not wired to SecAgg+ (a round with "
                          "nobody sampled would release no noise; fixed is)")
    if cfg.privacy.mode == "central" and cfg.privacy.adaptive_clip.enabled:
        raise ConfigError("privacy.adaptive_clip.enabled: not wired to SecAgg+ (the clipped "
                          "count would need its own masked sum)")
    if aggregator is not None:
        check_secure_aggregation(aggregator=aggregator, aggregator_name=cfg.aggregator.name,
                                 compressor=compressor, compressor_name=cfg.compression.name)


def _arrays(layout: Layout, w: torch.Tensor) -> list[np.ndarray]:
    """``w`` as the model's tensors, in ``layout``'s order (Flower's parameters)."""
    return [t.detach().cpu().numpy().copy() for t in layout.unflatten(w).values()]


def _vector(layout: Layout, dtype: torch.dtype, arrays: Sequence[np.ndarray]) -> torch.Tensor:
    """Flower's parameters ``arrays`` as the run's flat vector (in ``dtype``)."""
    names = [t.name for t in layout.tensors]
    if len(arrays) != len(names):
        raise ValueError(f"parameters: {len(arrays)} arrays, the model has {len(names)}")
    sd = OrderedDict((n, torch.from_numpy(np.asarray(a))) for n, a in zip(names, arrays,
                                                                         strict=True))
    return layout.flatten(sd).to(dtype)


# ------------------------------------------------------------------ client
class _SecAggClient(NumPyClient):
    def __init__(self, cfg: Config, k: int) -> None:
        self.cfg, self.k = cfg, k

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        exp = _experiment(self.cfg)
        k = int(config.get("client-id", self.k))
        r = int(config["fedloom-round"])
        lr = float(config["lr"])
        layout = exp.space.layout
        w = _vector(layout, exp.space.dtype, parameters)
        clients, local = exp.clients, exp.algorithm.local
        idx = torch.from_numpy(clients.fed.train[k])
        gen = torch.Generator()
        gen.manual_seed(derive_seed(self.cfg.seed, r, k, Purpose.BATCH))
        w_k, loss, steps = local.descend(w, w, clients.x[idx], clients.y[idx], lr, gen)
        u = (w - w_k).contiguous()
        privacy = make_privacy(self.cfg, clients.num_clients)
        if privacy.local:  # clip and noise before anything is sent (fedloom.privacy)
            u, _ = privacy.privatize(u if bool(torch.isfinite(u).all())
                                     else torch.zeros_like(u), r, k)
        comp = exp.algorithm.compressor
        sent = comp.decode(comp.encode(u, gen=torch_gen(self.cfg.seed, r, k, Purpose.COMPRESS)),
                           u.numel()).to(u.dtype)
        if privacy.central:  # the clip the in-process server applies to the decoded row
            sent, _, _ = clip_update(sent, privacy.clip)
        weight = len(idx) if _weighted(self.cfg) else 1
        return _arrays(layout, sent), int(weight), {"train-loss": float(loss), "num-steps": steps}


def _weighted(cfg: Config) -> bool:
    """ω_k = n_k (fedavg's default), or 1: unweighted, and under central DP (each
    client counts once, as in :mod:`fedloom.privacy`)."""
    return bool(cfg.aggregator.options.get("weighted", True)) and cfg.privacy.mode != "central"


def _hello_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """Answers the strategy's discovery (which client this node is) before SecAgg+."""
    if msg.metadata.message_type.startswith(MessageType.TRAIN) and HELLO_KEY in msg.content:
        return Message(RecordDict({HELLO_KEY: ConfigRecord({"client-id": _client_id(context)})}),
                       reply_to=msg)
    return call_next(msg, context)


def secagg_client_app(config: ConfigSource, overrides: Sequence[str] = ()) -> ClientApp:
    """A ClientApp whose update leaves the node only masked by ``secaggplus_mod``."""
    cfg = load_config(config, overrides)
    check_secagg_scope(cfg)

    def client_fn(context: Context) -> Any:
        return _SecAggClient(cfg, _client_id(context)).to_client()

    return ClientApp(client_fn=client_fn, mods=[_hello_mod, secaggplus_mod])


# ------------------------------------------------------------------ server
class SecAggStrategy(LegacyStrategy):
    """fedloom's cohort and server step on the unmasked average (module docstring).

    :attr:`state` is the engine's :class:`~fedloom.engine.runstate.RunState` (model
    and server optimizer state); :attr:`history` one entry per round.
    """

    def __init__(self, config: ConfigSource, overrides: Sequence[str] = (), *,
                 node_timeout: float = 120.0) -> None:
        cfg = load_config(config, overrides)
        check_secagg_scope(cfg)
        self.exp = Experiment.from_config(cfg)
        check_secagg_scope(cfg, self.exp.algorithm.aggregator, self.exp.algorithm.compressor)
        self.layout, self.dtype = self.exp.space.layout, self.exp.space.dtype
        self.state: RunState = self.exp.init()
        self.nodes: dict[int, int] = {}
        self.history: list[dict[str, Any]] = []
        self.node_timeout = node_timeout

    def model_sha256(self) -> str:
        return model_sha256(self.state.w)

    def discover(self, grid: Grid) -> None:
        """Which node is which client (each node's ``client-id``/``partition-id``)."""
        self.nodes = discover_clients(grid, self.exp.clients.num_clients, self.node_timeout,
                                      who="secagg", needs="SecAggStrategy needs fedloom's "
                                      "secagg_client_app on every node")

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(_arrays(self.layout, self.state.w))

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        r = self.state.next_round
        if server_round - 1 != r:
            raise RuntimeError(f"secagg: server round {server_round} does not follow fedloom "
                               f"round {r}")
        by_node = {p.node_id: p for p in client_manager.all().values()}
        cohort = self.exp.schedule.sample_cohort(r).tolist()
        params = ndarrays_to_parameters(_arrays(self.layout, self.state.w))
        conf = {"fedloom-round": r, "lr": float(self.exp.schedule.lr(r))}
        return [(by_node[self.nodes[k]], FitIns(params, {**conf, "client-id": int(k)}))
                for k in cohort]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[Parameters | None, dict[str, Any]]:
        st = self.state
        if not results:  # nothing unmasked: no step (the engine's rule for an empty round)
            self.state = RunState(st.next_round + 1, st.w, st.opt_state, st.agg_state,
                                  st.method_state, st.feedback_state, st.w_avg, st.totals,
                                  privacy_state=st.privacy_state, buffers=st.buffers,
                                  clients=st.clients, evaluation=st.evaluation)
            return ndarrays_to_parameters(_arrays(self.layout, st.w)), {}
        # Every result carries the same unmasked average Σ ω_k u_k / Σ ω_k.
        agg = _vector(self.layout, self.dtype, parameters_to_ndarrays(results[0][1].parameters))
        if self.exp.privacy.central:
            # ω_k = 1: the sum of the clipped updates is m × the average; DP-FedAvg's
            # noise and fixed denominator as in-process (fedloom.privacy.release).
            total = agg.double() * len(results)
            agg = self.exp.privacy.release(total, st.privacy_state, st.next_round
                                           ).to(self.dtype)
        w, opt = self.exp.algorithm.server.step(st.w, agg, st.opt_state)
        privacy_state = st.privacy_state
        if self.exp.privacy.local:
            ids = torch.tensor(sorted(k for k, nid in self.nodes.items()
                                      if nid in {p.node_id for p, _ in results}))
            privacy_state = self.exp.privacy.participated(privacy_state, ids)
        self.state = RunState(st.next_round + 1, w, opt, st.agg_state, st.method_state,
                              st.feedback_state, st.w_avg, st.totals,
                              privacy_state=privacy_state, buffers=st.buffers,
                              clients=st.clients, evaluation=st.evaluation)
        m: dict[str, Any] = {"round": server_round, "cohort_size": len(results),
                             "failures": len(failures)}
        if self.exp.privacy.enabled:
            m["dp_epsilon"] = self.exp.privacy.epsilon(privacy_state, st.next_round + 1)
        self.history.append(m)
        return ndarrays_to_parameters(_arrays(self.layout, w)), {}

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[tuple[ClientProxy,
                                                                         EvaluateIns]]:
        return []  # the server evaluates (below)

    def aggregate_evaluate(self, server_round: int, results: list[Any],
                           failures: list[Any]) -> tuple[float | None, dict[str, Any]]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters
                 ) -> tuple[float, dict[str, Any]] | None:
        if server_round == 0:
            return None
        out = self.exp.evaluate(self.state.w, self.state)
        if self.history:
            self.history[-1].update(out)
        return float(out["test_loss"]), {"test_acc": float(out["test_acc"])}


def secagg_server_app(strategy: SecAggStrategy, num_rounds: int | None = None, *,
                      num_shares: int | float = 1.0, reconstruction_threshold: int | float = 0.67,
                      **secagg: Any) -> ServerApp:
    """A ServerApp running ``strategy`` under Flower's ``SecAggPlusWorkflow``
    (``num_shares``, ``reconstruction_threshold`` and ``secagg`` — ``max_weight``,
    ``clipping_range``, ``quantization_range``, ``modulus_range``, ``timeout`` —
    go to it). ``max_weight`` defaults to the largest client sample count."""
    app = ServerApp()
    rounds = num_rounds or strategy.exp.cfg.rounds
    secagg.setdefault("max_weight", float(max(len(t) for t in strategy.exp.clients.fed.train))
                      if _weighted(strategy.exp.cfg) else 1.0)

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.discover(grid)
        ctx = LegacyContext(context=context, config=ServerConfig(num_rounds=rounds),
                            strategy=strategy)
        workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(
            num_shares=num_shares, reconstruction_threshold=reconstruction_threshold, **secagg))
        workflow(grid, ctx)

    return app
