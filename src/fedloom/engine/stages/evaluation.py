"""Evaluation: the global model on the global and per-client test splits, and the
personal models of a local method that keeps them.

The global model's pooled metrics (``test_*``) and per-client ones (``client_*``)
come from one forward pass over the clients' test splits when the pooled test set
is their union, sample for sample (a source without a test set of its own, the text
source for one: :func:`fedloom.data.federated.build_federated`); the numbers are
those of a pass over each, bit for bit (the same batches, the same reductions:
:func:`fedloom.metrics.evaluate_pooled_and_clients`). A source's own test set, or
``data.feature``'s skew (applied to the clients' rows, not to the pooled set),
keeps the two passes.

Under ``model.buffers=local`` (FedBN) a client's own split is evaluated with
its own buffers once it has any. The personal models are the local method's
(:meth:`fedloom.client.methods.LocalMethod.personal_models`, from its own
per-client rows): the engine knows no method's fields.

:class:`Evaluator` holds what evaluation reads (the model space, the clients,
the global test set, the eval settings, the local update and method for the
fine-tuned and personal evaluations) and nothing of a run: the client rows it reads
are the state's (``store``), and :meth:`Evaluator.round` returns the per-client
numbers (``client_acc.json``) with the metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedloom.buffers import unflatten_buffers
from fedloom.config import EvalConfig
from fedloom.device import to_device
from fedloom.engine.clientfields import BUFFERS, METHOD
from fedloom.engine.inputs import ClientData, ModelSpace
from fedloom.engine.runstate import LastPerClient
from fedloom.metrics import (
    accuracy_stats,
    evaluate,
    evaluate_clients,
    evaluate_clients_lm,
    evaluate_pooled_and_clients,
    perplexity_stats,
)
from fedloom.rng import derive_seed
from fedloom.state import ClientStateStore

__all__ = ["Evaluator", "LastPerClient"]

_NONE = np.zeros(0, dtype=np.int64)


def _same_rows(x_test: torch.Tensor, y_test: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               idx: torch.Tensor, chunk: int = 4096) -> bool:
    """Whether ``(x_test, y_test)`` is ``(x[idx], y[idx])`` exactly (same rows, same
    order, same dtype), compared ``chunk`` rows at a time so that no second copy of a
    large test set is made at once. No rows (no client has a test split): False, the
    pooled set being then the training samples."""
    n = int(idx.numel())
    if (n == 0 or x_test.shape[1:] != x.shape[1:] or x_test.shape[0] != n
            or y_test.shape[1:] != y.shape[1:] or y_test.shape[0] != n
            or x_test.dtype != x.dtype or y_test.dtype != y.dtype):
        return False
    for s in range(0, n, chunk):
        part = idx[s : s + chunk]
        if not (torch.equal(x_test[s : s + chunk], x[part])
                and torch.equal(y_test[s : s + chunk], y[part])):
            return False
    return True


class Evaluator:
    """The global model on the global and per-client test splits; personal and
    fine-tuned per-client accuracies (see the module docstring)."""

    def __init__(self, space: ModelSpace, clients: ClientData, x_test: torch.Tensor,
                 y_test: torch.Tensor, settings: EvalConfig, *, seed: int, local: Any,
                 method: Any, client_lr: float,
                 extra: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.space, self.clients = space, clients
        # named test sets whose accuracy is a metric of its own (a backdoor's triggered
        # samples: the attack success rate)
        self.extra = dict(extra or {})
        self.x_test, self.y_test = x_test, y_test
        self.settings, self.seed = settings, seed
        self.local, self.method, self.client_lr = local, method, client_lr
        # All clients' test samples in one tensor, with the owner of each, so the
        # per-client evaluation is one pass of the model.
        # a population (generated on demand) keeps no client test split: its global
        # test set is its held-out users'
        test_idx = list(clients.fed.test) if clients.fed.population is None else []
        self.client_test_idx = torch.from_numpy(np.concatenate(test_idx or [_NONE])).long().to(
            space.device)
        self.client_test_owner = torch.from_numpy(
            np.concatenate([np.full(len(t), k) for k, t in enumerate(test_idx)] or [_NONE])
        ).long().to(space.device)
        # The pooled test set is the union of the clients' splits, in this order, when
        # the source has no test set of its own (FederatedData; the text source, for
        # one): then one forward pass gives both the pooled and the per-client metrics.
        # Checked on the tensors rather than assumed from the source, since a source's
        # own test set, data.feature's skew of the clients' rows (not of the pooled
        # set) or data given to run() make the two differ.
        self.pooled_is_clients = _same_rows(x_test, y_test, clients.x, clients.y,
                                            self.client_test_idx)

    def round(self, w: torch.Tensor, w_eval: torch.Tensor, r: int, store: ClientStateStore,
              last: LastPerClient, *, personal: bool) -> tuple[dict[str, float], LastPerClient]:
        """Round ``r``'s evaluation: :meth:`global_` of ``w_eval`` (the model, or the
        iterates' mean), :meth:`personal` (``personal``: the method keeps personal
        models) and :meth:`finetuned` of ``w``, where they apply; the metrics, and
        ``last`` with the per-client numbers taken now in place of its own."""
        out, taken = self._global(w_eval, store)
        if personal:
            own, mine = self._personal(w, store)
            out.update(own)
            taken.update(mine)
        if self.settings.finetune_steps:
            out.update(self.finetuned(w, r, store))
        return out, replace(last, **taken)

    def global_(self, w: torch.Tensor, store: ClientStateStore | None = None
                ) -> dict[str, float]:
        """Global test accuracy/loss and per-client accuracy statistics of ``w`` (a
        causal LM: token accuracy, and perplexity pooled and per client). One forward
        pass when the pooled test set is the clients' splits
        (:attr:`pooled_is_clients`), else one over each. ``store``: the client rows
        (``model.buffers=local``: a client's own buffers; ``None``: the global ones
        for every client)."""
        return self._global(w, store)[0]

    def _global(self, w: torch.Tensor, store: ClientStateStore | None
                ) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """:meth:`global_`, and the per-client arrays taken (``client_acc``,
        ``client_ppl``: :class:`LastPerClient`'s names)."""
        sp, cl = self.space, self.clients
        bs = self.settings.batch_size
        lm = self.y_test.ndim > 1  # a causal LM's next tokens: token accuracy, perplexity
        ppl: np.ndarray | None = None
        if self.pooled_is_clients:
            (acc, loss), per_client, ppl = evaluate_pooled_and_clients(
                sp.module, sp.layout, w, cl.x[self.client_test_idx],
                cl.y[self.client_test_idx], self.client_test_owner, cl.num_clients, bs)
        else:
            acc, loss = evaluate(sp.module, sp.layout, w, self.x_test, self.y_test, bs)
            if self.client_test_idx.numel() and lm:
                per_client, ppl = evaluate_clients_lm(
                    sp.module, sp.layout, w, cl.x[self.client_test_idx],
                    cl.y[self.client_test_idx], self.client_test_owner, cl.num_clients, bs)
            elif self.client_test_idx.numel():
                per_client = evaluate_clients(
                    sp.module, sp.layout, w, cl.x[self.client_test_idx],
                    cl.y[self.client_test_idx], self.client_test_owner, cl.num_clients, bs)
        out = {"test_acc": acc, "test_loss": loss}
        for name, (xs, ys) in self.extra.items():
            out[name] = evaluate(sp.module, sp.layout, w, xs, ys, bs)[0]
        taken: dict[str, np.ndarray] = {}
        if lm:
            out["test_ppl"] = math.exp(min(loss, 700.0)) if math.isfinite(loss) else loss
        if not self.client_test_idx.numel():
            return out, taken
        if not lm and cl.fields.has(BUFFERS) and store is not None:
            # FedBN: a client's own split with its own statistics (the pass above used
            # the global buffers, as the pooled metrics should)
            for k, bufs in self.local_buffers(store, range(cl.num_clients)):
                idx = torch.from_numpy(cl.fed.test[k])
                if len(idx):
                    per_client[k], _ = evaluate(sp.module, sp.layout, w, cl.x[idx],
                                                cl.y[idx], bs, buffers=bufs)
        out.update(accuracy_stats(per_client))
        taken["client_acc"] = per_client
        if ppl is not None:
            out.update(perplexity_stats(ppl))
            taken["client_ppl"] = ppl
        return out, taken

    def local_buffers(self, store: ClientStateStore, ids: Sequence[int], chunk: int = 256
                      ) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """``(client, its own buffers)`` in ``store`` for the clients of ``ids`` that
        have any (``model.buffers=local``)."""
        f = self.clients.fields
        out = []
        ids = list(ids)
        for s in range(0, len(ids), chunk):
            part = ids[s : s + chunk]
            have = store.gather(f.key(BUFFERS, "buffers_set"), part)[:, 0] > 0
            if not bool(have.any()):
                continue
            rows = store.gather(f.key(BUFFERS, "buffers"), part)
            out += [(k, unflatten_buffers(rows[j], self.space.buffer_template))
                    for j, k in enumerate(part) if bool(have[j])]
        return out

    def personal(self, w: torch.Tensor, store: ClientStateStore, chunk: int = 64
                 ) -> dict[str, float]:
        """:meth:`_personal`'s metrics."""
        return self._personal(w, store, chunk)[0]

    def _personal(self, w: torch.Tensor, store: ClientStateStore, chunk: int = 64
                  ) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """Per-client accuracy of the local method's personal models (from their rows
        in ``store``; with the arrays taken, ``personal_acc`` and ``personal_ppl``,
        as :meth:`_global`), each on its
        client's own test split (``personal_acc_*``, over the clients that have one);
        the clients that have none yet — never sampled, so no personal state — are
        reported apart, with the global model (``unsampled_acc_*``), and
        ``personal_clients`` counts the first group.

        A causal LM (labels ``[N, T]``): the accuracies are token accuracies, and each
        client's test perplexity, ``exp`` of its mean token cross-entropy, is reported
        the same way (``personal_ppl_*`` and ``unsampled_ppl_*``:
        :func:`~fedloom.metrics.perplexity_stats`, lower is better, ``worst10`` the
        highest); a client's loss is the log of its perplexity. One forward pass a
        client: its model is its own. A population keeps no client test split: none."""
        sp, cl = self.space, self.clients
        if cl.fed.population is not None:
            return {}, {}
        n = cl.num_clients
        lm = cl.y.ndim > 1
        acc = np.full(n, np.nan)
        unsampled = np.full(n, np.nan)
        ppl = np.full(n, np.nan)
        unsampled_ppl = np.full(n, np.nan)
        bs = self.settings.batch_size
        f = cl.fields
        for s in range(0, n, chunk):
            ids = list(range(s, min(s + chunk, n)))
            rows = {name: store.gather(f.key(METHOD, name), ids) for name in f.names(METHOD)}
            found = self.method.personal_models(rows, w)
            if found is None:
                continue
            models, have = to_device(found[0], sp.device), found[1]
            for j, k in enumerate(ids):
                te = cl.fed.test[k]
                if len(te) == 0:
                    continue
                idx = torch.from_numpy(te)
                own = dict(self.local_buffers(store, [k])) if f.has(BUFFERS) else {}
                mine = bool(have[j])
                a, loss = evaluate(sp.module, sp.layout, models[j] if mine else w,
                                   cl.x[idx], cl.y[idx], bs, buffers=own.get(k))
                (acc if mine else unsampled)[k] = a
                if lm:  # exp in float64 as evaluate_clients_lm's client_ppl (inf past e^709)
                    (ppl if mine else unsampled_ppl)[k] = float(
                        torch.exp(torch.tensor(loss, dtype=torch.float64)))
        taken: dict[str, np.ndarray] = {"personal_acc": acc}
        out = accuracy_stats(acc, prefix="personal_acc")
        out.update(accuracy_stats(unsampled, prefix="unsampled_acc"))
        if lm:
            taken["personal_ppl"] = ppl
            out.update(perplexity_stats(ppl, prefix="personal_ppl"))
            out.update(perplexity_stats(unsampled_ppl, prefix="unsampled_ppl"))
        out["personal_clients"] = float(np.count_nonzero(~np.isnan(acc)))
        return out, taken

    def finetuned(self, w: torch.Tensor, round: int, store: ClientStateStore
                  ) -> dict[str, float]:
        """``eval.finetune_steps`` local SGD steps from the global model on each
        client's own training data, then its own test split (``finetune_acc_*``): how
        FedBABU (Oh et al., ICLR 2022) and Per-FedAvg evaluate, for any method. The
        steps use the client's training settings (lr, batch, momentum, weight decay;
        no prox), every parameter free, batches from (seed, round, client,
        ``finetune``; ``store``: the client rows, for their own buffers); the global
        model is not changed."""
        sp, cl = self.space, self.clients
        steps = self.settings.finetune_steps
        acc = np.full(cl.num_clients, np.nan)
        bs = self.settings.batch_size
        for k in range(cl.num_clients):
            te, tr = cl.fed.test[k], cl.fed.train[k]
            if len(te) == 0 or len(tr) == 0:
                continue
            own = dict(self.local_buffers(store, [k])) if cl.fields.has(BUFFERS) else {}
            gen = torch.Generator()
            gen.manual_seed(derive_seed(self.seed, round, k, "finetune"))
            itr = torch.from_numpy(tr)
            # epochs enough for `steps` steps (with client.steps set: at most that many)
            epochs = max(1, math.ceil(steps / math.ceil(len(tr) / self.local.batch_size)))
            v, _, _ = self.local.descend(w, w, cl.x[itr], cl.y[itr], self.client_lr, gen,
                                         prox_mu=0.0, buffers=own.get(k), epochs=epochs,
                                         max_steps=steps)
            ite = torch.from_numpy(te)
            acc[k], _ = evaluate(sp.module, sp.layout, v, cl.x[ite], cl.y[ite], bs,
                                 buffers=own.get(k))
        return accuracy_stats(acc, prefix="finetune_acc")
