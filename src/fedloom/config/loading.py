"""Reading a config: the bounded YAML loaders, ``a.b.c=value`` overrides, and
:func:`load_config` (a YAML file, a mapping or a Config, then the overrides).

YAML is read with bounds (:func:`yaml_load`, :func:`safe_load_bounded`): aliases
may add at most :data:`MAX_ALIAS_NODES` nodes to a document (an alias bomb of
nine anchors of nine aliases, 9**9 leaves, is refused in 26 ms; unbounded it
hung ``fedloom run`` for over a minute), no alias may refer to its own anchor,
and nesting stops at :data:`MAX_DEPTH` levels (PyYAML raised RecursionError past
~490, at Python's default recursion limit). A config file with no settings
(empty, only comments, ``null``) is refused. An integer literal longer than
Python's int-parsing limit (``sys.get_int_max_str_digits()``, 4300 digits) is
refused naming the source and line (int() raised a ValueError that named neither).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from fedloom import recorded
from fedloom.config.checks import config_from_dict, config_to_dict, did_you_mean
from fedloom.config.sections import SHORTHAND_SECTIONS, Config, ConfigError
from fedloom.config.translate import respell, twins

# What aliases may add to a document, in nodes of the tree they expand to, and how
# deep a document may nest. A config is a few hundred nodes, eight levels deep; an
# alias bomb (nine anchors, each nine aliases of the one before) is 9**9 leaves.
MAX_ALIAS_NODES = 10_000
MAX_DEPTH = 100


class _Refused(yaml.MarkedYAMLError):
    """A document refused while composing it (raised as ConfigError by _load)."""


def _mark(event: yaml.Event) -> yaml.error.Mark | None:
    """Where ``event`` starts. SafeLoader is the pure-Python loader, whose marks are
    yaml.error.Marks (PyYAML's stubs also allow the C loader's)."""
    m = event.start_mark
    return m if isinstance(m, yaml.error.Mark) else None


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts, while composing, the nodes aliases add.

    PyYAML composes an alias as the anchored node itself, so the composed graph is
    as small as the file, but every consumer that walks it as a tree
    (``dataclasses.asdict``, ``==``, the schema's own checks) visits each alias's whole
    subtree again. Each node's expanded size (itself plus its children's, an alias
    counting as its target's) is recorded when its composition ends; an alias adds
    its target's size to the document's running extra, refused past
    :data:`MAX_ALIAS_NODES`. An alias to a node still being composed is recursive
    (a list that holds itself: an endless tree) and refused; so is nesting deeper
    than :data:`MAX_DEPTH` (PyYAML's composer recurses per level: a RecursionError
    after ~490 levels otherwise, at the default recursion limit). A merge key
    (``<<: *a``) is an alias like any other, counted as its target's size, an
    upper bound of the entries it copies.
    The work is one step per composed node, whatever the expansion would be."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}   # id(node) -> expanded size, once composed
        self._open: list[int] = []         # expanded size so far of each open node
        self._extra = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._alias(self.peek_event())
            return super().compose_node(parent, index)
        if len(self._open) >= MAX_DEPTH:
            raise _Refused(problem=f"nested more than {MAX_DEPTH} levels deep",
                           problem_mark=_mark(self.peek_event()))
        self._open.append(1)
        node = super().compose_node(parent, index)
        size = self._open.pop()
        self._sizes[id(node)] = size
        if self._open:
            self._open[-1] += size
        return node

    def _alias(self, event: yaml.AliasEvent) -> None:
        mark = _mark(event)
        target = self.anchors.get(event.anchor)
        if target is None:  # an undefined alias: the composer's own error follows
            return
        size = self._sizes.get(id(target))
        if size is None:
            raise _Refused(problem=f"recursive alias *{event.anchor} (an anchor used "
                                   "inside itself)", problem_mark=mark)
        self._extra += size
        if self._extra > MAX_ALIAS_NODES:
            raise _Refused(problem=f"aliases expand to more than {MAX_ALIAS_NODES} "
                                   "nodes; write the values out", problem_mark=mark)
        if self._open:
            self._open[-1] += size


def _construct_int(loader: _BoundedLoader, node: yaml.ScalarNode) -> int:
    """``SafeConstructor.construct_yaml_int``, refusing (with its line) an integer
    longer than Python's int-parsing limit: ``int()`` raises a ValueError that names
    neither the file nor the line."""
    try:
        return int(yaml.SafeLoader.construct_yaml_int(loader, node))
    except ValueError:
        raise _Refused(problem=f"an integer of more than {sys.get_int_max_str_digits()} "
                               "digits", problem_mark=node.start_mark) from None


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


class _Loader(_BoundedLoader):
    """YAML with 1.2-style floats: ``1e-3`` is a number, not the string "1e-3"."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _load(text: str, source: str, loader: type[yaml.SafeLoader]) -> Any:
    try:
        return yaml.load(text, Loader=loader)
    except _Refused as e:
        mark = e.problem_mark
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{source}: {e.problem}{where}") from None


def read_yaml_file(path: Path, what: str) -> Any:
    """A YAML file a user wrote (a config, a sweep's suite), read as :func:`yaml_load`
    reads text; :class:`ConfigError`, one line naming the file (and the line), for a
    file that cannot be read, is not UTF-8 (a byte-order mark is skipped; no other
    encoding is guessed from the locale) or is not YAML, a Python tag included (the
    loader constructs no objects)."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte 0x{e.object[e.start]:02x} "
                          f"at offset {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    try:
        return yaml_load(text, str(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None


def yaml_load(text: str, source: str = "YAML text") -> Any:
    """A config's YAML (1.2-style floats), bounded as :class:`_BoundedLoader` says:
    an alias bomb, a recursive alias or deep nesting raises :class:`ConfigError`
    naming ``source`` and the line; malformed YAML raises ``yaml.YAMLError``."""
    return _load(text, source, _Loader)


def safe_load_bounded(text: str, source: str) -> Any:
    """``yaml.safe_load`` (YAML 1.1 resolvers, the ones ``yaml.safe_dump`` writes
    for) with :func:`yaml_load`'s bounds: for files fedloom wrote, such as a run
    directory's ``config.yaml``, whose strings like ``1e5`` must stay strings."""
    return _load(text, source, _BoundedLoader)


def _parse_value(text: str, key: str) -> Any:
    try:
        return yaml_load(text, f"override {key}") if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested mapping (a copy is returned).

    A section written as a string (``feedback: sapef``, short for ``{name: sapef}``)
    is expanded when an override sets a key inside it. An override that sets a
    ``{name, options}`` section to a string names the component: another component
    comes with no options (they were the old one's), the same one keeps its own
    (``compression.feedback=flare`` on a config whose FLARE has its ``tau``); set
    ``SECTION.name=NAME`` to keep the options whatever the name; the keys beside the
    options stay (``model=cnn`` keeps ``model.buffers``). ``backend=NAME`` keeps the
    backend's options too. Keys written the old way stay as given:
    :func:`~fedloom.config.config_from_dict` translates the result as a whole
    (:mod:`fedloom.config.translate`), once the component is known; one of the model's,
    the backend's or the data's that the mapping writes the new way is respelt
    (``model.hidden`` → ``model.options.hidden``, with a warning line:
    :func:`~fedloom.config.translate.respell`)."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE with a dotted key")
        key = respell(key, out)  # model.hidden on a model written with options
        for twin in twins(key):  # the same option spelt the other way: this one wins
            _delete(out, twin.split("."))
        parts = key.split(".")
        node: dict[str, Any] = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if isinstance(nxt, str) and ".".join(parts[: i + 1]) in SHORTHAND_SECTIONS:
                nxt = node[part] = {"name": nxt}
            if not isinstance(nxt, dict):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a section, cannot set {key}")
            node = nxt
        value = _parse_value(raw, key)
        old = node.get(parts[-1])
        if key in SHORTHAND_SECTIONS and isinstance(value, str) and isinstance(old, dict):
            if key == "backend" or old.get("name") == value:  # its keys stay
                value = {**old, "name": value}
            else:  # another component: the old one's options go, keys beside them stay
                value = {**{k: v for k, v in old.items() if k != "options"}, "name": value}
        node[parts[-1]] = value
    return out


def _delete(data: dict[str, Any], parts: list[str]) -> None:
    """Remove the dotted key ``parts`` from ``data`` if it is there."""
    node: Any = data
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(parts[-1], None)


def shipped_configs() -> list[str]:
    """The names of the configs shipped inside the package (``fedloom/configs/``), which
    ``fedloom run NAME`` finds from any folder, the package installed from a wheel too."""
    folder = Path(__file__).resolve().parent.parent / "configs"
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _resolve_config_path(source: str | Path) -> Path:
    """``source`` as a file, else a bare name (no folder, no suffix) of a shipped
    config; a path that exists always wins, so a local ``quickstart`` file is read."""
    path = Path(source)
    if path.is_file():
        return path
    if path.name == str(source) and not path.suffix:
        shipped = Path(__file__).resolve().parent.parent / "configs" / f"{path.name}.yaml"
        if shipped.is_file():
            return shipped
        names = shipped_configs()
        raise ConfigError(f"{path}: config file not found, nor a shipped config "
                          f"({did_you_mean(path.name, names)}shipped: "
                          f"{', '.join(names) or 'none'})")
    raise ConfigError(f"{path}: config file not found")


def load_config(
    source: str | Path | Mapping[str, Any] | Config, overrides: Sequence[str] = (),
    plugins: bool = True,
) -> Config:
    """Load a config from a YAML file (or the bare name of a shipped config, e.g.
    ``quickstart``), a mapping or a :class:`Config`, then apply overrides.
    ``plugins=False``: read it as data, importing no plug-in it names
    (:func:`~fedloom.config.config_from_dict`)."""
    if isinstance(source, Config):
        data = config_to_dict(source)
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        path = _resolve_config_path(source)
        data = read_yaml_file(path, "config")
        if data is None:  # no document, or only ``null``: never the defaults, silently
            raise ConfigError(f"{path}: the file has no settings (it is empty or holds "
                              "only comments)")
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: must hold a mapping at the top level")
        data.setdefault("name", path.stem)
        # a run directory's record names its own files run:NAME (fedloom.engine.given)
        data = recorded.run_files(data, path.parent)
    return config_from_dict(apply_overrides(data, overrides), plugins)
