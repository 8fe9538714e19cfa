"""Evaluation: the global model on the global and per-client test splits, and the
personal models of a local method that keeps them.

Under ``model.buffers=local`` (FedBN) a client's own split is evaluated with
its own buffers once it has any. The personal models are the local method's
(:meth:`fedloom.client.methods.LocalMethod.personal_models`, from its own
per-client rows): the engine knows no method's fields.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from fedloom.buffers import unflatten_buffers
from fedloom.device import to_device
from fedloom.engine.fields import BUFFERS, METHOD
from fedloom.engine.setup import Setup
from fedloom.metrics import accuracy_stats, evaluate, evaluate_clients

__all__ = ["evaluate_finetuned", "evaluate_global", "evaluate_personal", "local_buffers"]


def evaluate_global(exp: Setup, w: torch.Tensor) -> dict[str, float]:
    """Global test accuracy/loss and per-client accuracy statistics of ``w``."""
    bs = exp.cfg.eval.batch_size
    acc, loss = evaluate(exp.module, exp.layout, w, exp.x_test, exp.y_test, bs)
    out = {"test_acc": acc, "test_loss": loss}
    if exp.client_test_idx.numel():
        per_client = evaluate_clients(
            exp.module, exp.layout, w, exp.x[exp.client_test_idx],
            exp.y[exp.client_test_idx], exp.client_test_owner, exp.fed.num_clients, bs,
        )
        if exp.fields.has(BUFFERS):  # FedBN: a client's own split with its own statistics
            for k, bufs in local_buffers(exp, range(exp.fed.num_clients)):
                idx = torch.from_numpy(exp.fed.test[k])
                if len(idx):
                    per_client[k], _ = evaluate(exp.module, exp.layout, w, exp.x[idx],
                                                exp.y[idx], bs, buffers=bufs)
        out.update(accuracy_stats(per_client))
        exp.last_client_acc = per_client
    return out


def local_buffers(exp: Setup, ids: Sequence[int], chunk: int = 256
                  ) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """``(client, its own buffers)`` for the clients of ``ids`` that have any
    (``model.buffers=local``)."""
    out = []
    ids = list(ids)
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        have = exp.store.gather(exp.fields.key(BUFFERS, "buffers_set"), part)[:, 0] > 0
        if not bool(have.any()):
            continue
        rows = exp.store.gather(exp.fields.key(BUFFERS, "buffers"), part)
        out += [(k, unflatten_buffers(rows[j], exp.buffer_template))
                for j, k in enumerate(part) if bool(have[j])]
    return out


def evaluate_personal(exp: Setup, w: torch.Tensor, chunk: int = 64) -> dict[str, float]:
    """Per-client accuracy of the local method's personal models, each on its
    client's own test split (``personal_acc_*``, over the clients that have one);
    the clients that have none yet — never sampled, so no personal state — are
    reported apart, with the global model (``unsampled_acc_*``), and
    ``personal_clients`` counts the first group."""
    acc = np.full(exp.fed.num_clients, np.nan)
    unsampled = np.full(exp.fed.num_clients, np.nan)
    bs = exp.cfg.eval.batch_size
    f = exp.fields
    for s in range(0, exp.fed.num_clients, chunk):
        ids = list(range(s, min(s + chunk, exp.fed.num_clients)))
        rows = {n: exp.store.gather(f.key(METHOD, n), ids) for n in f.names(METHOD)}
        found = exp.method.personal_models(rows, w)
        if found is None:
            continue
        models, have = to_device(found[0], exp.device), found[1]
        for j, k in enumerate(ids):
            te = exp.fed.test[k]
            if len(te) == 0:
                continue
            idx = torch.from_numpy(te)
            own = dict(local_buffers(exp, [k])) if f.has(BUFFERS) else {}
            target = acc if bool(have[j]) else unsampled
            target[k], _ = evaluate(exp.module, exp.layout, models[j] if bool(have[j]) else w,
                                    exp.x[idx], exp.y[idx], bs, buffers=own.get(k))
    exp.last_personal_acc = acc
    out = accuracy_stats(acc, prefix="personal_acc")
    out.update(accuracy_stats(unsampled, prefix="unsampled_acc"))
    out["personal_clients"] = float(np.count_nonzero(~np.isnan(acc)))
    return out


def evaluate_finetuned(exp: Setup, w: torch.Tensor, round: int) -> dict[str, float]:
    """``eval.finetune_steps`` local SGD steps from the global model on each
    client's own training data, then its own test split (``finetune_acc_*``): how
    FedBABU (Oh et al., ICLR 2022) and Per-FedAvg evaluate, for any method. The
    steps use the client's training settings (lr, batch, momentum, weight decay;
    no prox), every parameter free, batches from (seed, round, client,
    ``finetune``); the global model is not changed."""
    from fedloom.rng import derive_seed

    steps = exp.cfg.eval.finetune_steps
    acc = np.full(exp.fed.num_clients, np.nan)
    bs = exp.cfg.eval.batch_size
    for k in range(exp.fed.num_clients):
        te, tr = exp.fed.test[k], exp.fed.train[k]
        if len(te) == 0 or len(tr) == 0:
            continue
        own = dict(local_buffers(exp, [k])) if exp.fields.has(BUFFERS) else {}
        gen = torch.Generator()
        gen.manual_seed(derive_seed(exp.cfg.seed, round, k, "finetune"))
        itr = torch.from_numpy(tr)
        # epochs enough for `steps` steps (with client.steps set: at most that many)
        epochs = max(1, math.ceil(steps / math.ceil(len(tr) / exp.trainer.batch_size)))
        v, _, _ = exp.trainer.descend(w, w, exp.x[itr], exp.y[itr], exp.cfg.client.lr, gen,
                                      prox_mu=0.0, buffers=own.get(k), epochs=epochs,
                                      max_steps=steps)
        ite = torch.from_numpy(te)
        acc[k], _ = evaluate(exp.module, exp.layout, v, exp.x[ite], exp.y[ite], bs,
                             buffers=own.get(k))
    return accuracy_stats(acc, prefix="finetune_acc")
