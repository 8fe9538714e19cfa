"""Evaluation: the global model on the global and per-client test splits, and the
personal models of a local method that keeps them.

Under ``model.buffers=local`` (FedBN) a client's own split is evaluated with
its own buffers once it has any. The personal models are the local method's
(:meth:`fedloom.client.methods.LocalMethod.personal_models`, from its own
per-client rows): the engine knows no method's fields.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedloom.buffers import unflatten_buffers
from fedloom.device import to_device
from fedloom.engine.fields import BUFFERS, METHOD
from fedloom.engine.setup import Setup
from fedloom.metrics import accuracy_stats, evaluate, evaluate_clients

__all__ = ["evaluate_global", "evaluate_personal", "local_buffers"]


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
    """Per-client accuracy of the local method's personal models (``w`` where a
    client has none yet)."""
    acc = np.full(exp.fed.num_clients, np.nan)
    bs = exp.cfg.eval.batch_size
    f = exp.fields
    for s in range(0, exp.fed.num_clients, chunk):
        ids = list(range(s, min(s + chunk, exp.fed.num_clients)))
        rows = {n: exp.store.gather(f.key(METHOD, n), ids) for n in f.names(METHOD)}
        found = exp.method.personal_models(rows)
        if found is None:
            continue
        models, have = to_device(found[0], exp.device), found[1]
        for j, k in enumerate(ids):
            te = exp.fed.test[k]
            if len(te) == 0:
                continue
            v = models[j] if bool(have[j]) else w
            idx = torch.from_numpy(te)
            own = dict(local_buffers(exp, [k])) if f.has(BUFFERS) else {}
            acc[k], _ = evaluate(exp.module, exp.layout, v, exp.x[idx], exp.y[idx], bs,
                                 buffers=own.get(k))
    exp.last_personal_acc = acc
    return accuracy_stats(acc, prefix="personal_acc")
