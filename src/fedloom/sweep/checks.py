"""Checks made before anything runs.

:func:`validate_suite` loads and validates every config a sweep can run (each
method × setting; ``$TUNE`` replaced by each value of its grid, or each point a
tuning or sensitivity run can take) and checks each run folder's name as one
folder name: a bad one is one :class:`~fedloom.config.ConfigError` line naming
the suite file, the method, the setting and the field. :func:`drop_missing_data`
leaves out the settings whose data is not on this machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedloom.config import ConfigError
from fedloom.sweep.suite import TUNE, Suite, _applies, _run_folder, _tune_tag
from fedloom.tuning import (
    Range,
    grid_points,
    overrides,
    point_slug,
)


def validate_suite(suite: Suite) -> int:
    """Load and validate every method × setting config (``$TUNE`` replaced by each
    value of the method's grid) before anything runs; return how many were
    checked. Raises :class:`ConfigError`: one line naming the suite file, the
    method, the setting and the field."""
    from fedloom.config import load_config

    if suite.tuning.protocol is not None:
        return _validate_protocol(suite)
    for method, t in suite.tuning.grids.items():  # each tuning run's folder is one folder name
        for v in t["grid"]:
            _run_folder(suite, method, _tune_tag(v))
    n = 0
    for setting, st in suite.settings.items():
        for method, ov in suite.methods.items():
            if not _applies(suite, method, setting):
                continue
            values: list[Any] = [None]
            if any(TUNE in o for o in ov):
                src = suite.tuning.shared.get(method, method)
                if src not in suite.tuning.grids:
                    raise ConfigError(f"{suite.path}: methods.{method}: uses {TUNE} but has "
                                      "no tune entry")
                values = list(suite.tuning.grids[src]["grid"])
            for v in values:
                ov2 = [o.replace(TUNE, str(v)) for o in ov] if v is not None else ov
                try:
                    load_config(st["config"], [*st.get("overrides", []), *ov2,
                                               f"seed={suite.seeds[0] if suite.seeds else 0}"])
                except ConfigError as e:
                    at = f" with {TUNE}={v}" if v is not None else ""
                    raise ConfigError(f"{suite.path}: methods.{method} (setting {setting}"
                                      f"{at}): {str(e).splitlines()[0]}") from None
                n += 1
    return n


def _check_points(suite: Suite, setting: str, method: str, points: list[dict[str, Any]],
                  extra: list[str] | None = None) -> int:
    from fedloom.config import load_config

    st = suite.settings[setting]
    for point in points:
        try:
            load_config(st["config"], [*st.get("overrides", []), *suite.methods[method],
                                       *overrides(point), *(extra or []),
                                       f"seed={suite.seeds[0] if suite.seeds else 0}"])
        except ConfigError as e:
            at = f" at {point_slug(point)}" if point else ""
            raise ConfigError(f"{suite.path}: methods.{method} (setting {setting}{at}): "
                              f"{str(e).splitlines()[0]}") from None
    return len(points)


def _validate_protocol(suite: Suite) -> int:
    """Every point a tuning or sensitivity run can take, loaded before anything runs; a
    grid smaller than the budget is refused (fedloom.tuning)."""
    proto = suite.tuning.protocol
    assert proto is not None
    n = 0
    for setting in suite.settings:
        tr = suite.settings[setting].get("tuning_rounds", proto.rounds)
        rounds = [f"rounds={tr}"] if tr else []
        for method in suite.methods:
            if not _applies(suite, method, setting):
                continue
            if suite.tuned(method):
                space = suite.space(setting, method)
                if proto.sampler in ("grid", "halving"):  # halving: the grid sampler's trials
                    pts = grid_points(space, proto.budget, proto.seed, setting, method)
                else:
                    # each range at both ends, each list value once (with the others' first)
                    pts = []
                    for k, v in space.items():
                        vals = [v.low, v.high] if isinstance(v, Range) else list(v)
                        base = {k2: (v2.low if isinstance(v2, Range) else v2[0])
                                for k2, v2 in space.items()}
                        pts += [{**base, k: x} for x in vals]
                n += _check_points(suite, setting, method, pts, rounds)
                for pt in pts:  # each trial's folder is one folder name
                    _run_folder(suite, method, f"@tune={point_slug(pt)}")
            else:
                n += _check_points(suite, setting, method, [{}])
            sens = proto.sensitivity
            if sens and _sensitive(suite, method):
                sens_pts = [{sens["key"]: v} for v in _sens_values(suite, setting, method)]
                n += _check_points(suite, setting, method, sens_pts)
                for pt in sens_pts:
                    _run_folder(suite, method, f"@sens={point_slug(pt)}")
    return n


def _sens_values(suite: Suite, setting: str, method: str) -> list[Any]:
    """The sensitivity key's values: as given, else its list in the method's space."""
    sens = suite.tuning.protocol.sensitivity if suite.tuning.protocol else None
    if not sens:
        return []
    if sens["values"] is not None:
        return list(sens["values"])
    dim = suite.space(setting, method).get(sens["key"])
    if not isinstance(dim, list):
        raise ConfigError(f"{suite.path}: tuning.sensitivity: {sens['key']} has no list of "
                          f"values in methods.{method}'s space (setting {setting}); give "
                          "values:")
    return list(dim)


def _sensitive(suite: Suite, method: str) -> bool:
    sens = suite.tuning.protocol.sensitivity if suite.tuning.protocol else None
    return bool(sens) and sens is not None and (sens.get("methods") is None
                                                or method in sens["methods"])


def drop_missing_data(suite: Suite, log: Callable[[str], None]) -> list[str]:
    """Settings whose data is not on this machine are left out, each with one line
    saying what is missing and where it was looked for; returns their names. All
    missing: :class:`ConfigError` (the CLI's exit 2), nothing run."""
    from fedloom.config import load_config
    from fedloom.data.sources import missing_source

    gone: list[str] = []
    first = ""
    for setting, st in list(suite.settings.items()):
        cfg = load_config(st["config"], st.get("overrides", []))
        why = missing_source(cfg.data)
        if why is not None:
            log(f"setting {setting}: skipped, its data is missing: {why}")
            first = first or why
            gone.append(setting)
            del suite.settings[setting]
    if gone and not suite.settings:
        raise ConfigError(f"{suite.path}: no setting's data is here ({first})")
    return gone
