"""The typed experiment schema: YAML in, validated dataclasses out.

A config is a tree of dataclasses. Loading checks every field: an unknown key,
a wrong type or an out-of-range value raises :class:`ConfigError` whose message
is one line naming the dotted field (``client.lr: must be > 0, got -1``).
Overrides use the same dotted names (``fedloom run cfg.yaml client.lr=0.05``);
their values are parsed as YAML scalars/lists.

Config stays at the edge: the engine turns a validated :class:`Config` into
typed objects, and core code never sees dicts.

The package, by concern (every name below is importable from ``fedloom.config``):

- :mod:`fedloom.config.sections`: the dataclasses, one per section, with their
  defaults and bounds; :class:`ConfigError` and :data:`MAX_COUNT`;
- :mod:`fedloom.config.checks`: a mapping into a :class:`Config`, field by field,
  and the checks across fields (registered names, the system section);
- :mod:`fedloom.config.loading`: the bounded YAML loaders, ``a.b=value``
  overrides, and :func:`load_config`.
"""

from __future__ import annotations

from fedloom.config.checks import (  # noqa: F401  (re-exported)
    SYSTEM_QUANTITIES,
    check_name,
    check_system_config,
    config_from_dict,
    config_to_dict,
    field_bounds,
    metric_names,
    system_values,
)
from fedloom.config.loading import (  # noqa: F401  (re-exported)
    MAX_ALIAS_NODES,
    MAX_DEPTH,
    apply_overrides,
    load_config,
    safe_load_bounded,
    yaml_load,
)
from fedloom.config.sections import (  # noqa: F401  (re-exported)
    MAX_COUNT,
    AdaptiveClipConfig,
    AggregatorConfig,
    AttackConfig,
    BackendConfig,
    CheckpointConfig,
    ClientConfig,
    CohortConfig,
    CompressionConfig,
    Config,
    ConfigError,
    DataConfig,
    DeviceClass,
    EvalConfig,
    FeatureConfig,
    LoggingConfig,
    LoRAConfig,
    MetricsConfig,
    ModelConfig,
    PartitionConfig,
    PrivacyConfig,
    ScheduleConfig,
    ServerConfig,
    StateConfig,
    SystemConfig,
)

__all__ = [
    "Config",
    "ConfigError",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
]
