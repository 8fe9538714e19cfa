"""A Flower App built from a fedloom config (see docs/deploy.md)."""

from pathlib import Path

from flwr.app import Context

from fedloom.config import Config, load_config


def fedloom_config(context: Context) -> Config:
    """The run's fedloom config: ``config`` (a file in this package, or a path)
    and ``overrides`` from the app's run config (``flwr run --run-config``)."""
    name = str(context.run_config.get("config", "federation.yaml"))
    path = Path(name) if Path(name).is_absolute() else Path(__file__).parent / name
    overrides = str(context.run_config.get("overrides", "")).split()
    return load_config(path, overrides)
