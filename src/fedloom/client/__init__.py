"""Local training on a client."""

from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD, lr_at_round

__all__ = ["ClientJob", "ClientResult", "LocalSGD", "lr_at_round"]
