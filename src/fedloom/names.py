"""Names that become file or folder names: one check for all of them.

A suite's name, its settings' and methods' names, a tuned value in a run
folder's name, a report panel's name, a run's config ``name``: each becomes one
component of a path under a folder the user chose (a sweep's ``out:``, the
page's folder, ``runs/``). :func:`path_component` is the gate every such name
passes: it returns the name unchanged when ``folder / name`` is always a child
of ``folder``, else raises :class:`~fedloom.config.ConfigError` (one line naming
the field and why) before anything is written. Names that are labels rather than
identifiers (``SA-PEF (α=0.85)``) are first made into one with
:func:`encode_component`, which replaces every other character by ``_``.
"""

from __future__ import annotations

from fedloom.config import ConfigError

__all__ = ["NAME_MAX", "encode_component", "path_component"]

# The longest file name Linux file systems take (bytes of its UTF-8 form).
NAME_MAX = 255


def encode_component(text: str, keep: str = "-_.") -> str:
    """``text`` with every character that is neither alphanumeric nor in ``keep``
    replaced by ``_`` (no ``/`` survives, so the result is one component unless it
    is ``.``, ``..`` or empty, which :func:`path_component` refuses).

    >>> encode_component("CRAFT (lr=0.1)")
    'CRAFT__lr_0.1_'
    >>> encode_component("a/b=1,c", keep="-_.=,")
    'a_b=1,c'
    """
    return "".join(c if c.isalnum() or c in keep else "_" for c in text)


def _why_not(name: str) -> str | None:
    if not name:
        return "it is empty"
    if name in (".", ".."):
        return "it names a folder above or the folder itself"
    for c in name:
        if c in "/\\":
            return f"it holds {c!r}, a path separator"
        if c == "\0" or ord(c) < 0x20 or ord(c) == 0x7F:
            return f"it holds the control character {c!r}"
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > NAME_MAX:
        return f"it is {size} bytes long, more than a file name's {NAME_MAX}"
    return None


def path_component(name: object, field: str) -> str:
    """``name`` itself when it can be one file or folder name: a non-empty string,
    not ``.`` or ``..``, without ``/``, ``\\`` or control characters, at most
    :data:`NAME_MAX` bytes. So ``folder / name`` is always a child of ``folder``
    (an absolute ``name`` would replace ``folder``; one with ``..`` would climb out
    of it). Otherwise :class:`ConfigError`: ``FIELD: 'NAME' cannot name a file or
    folder (why)``.

    >>> path_component("craft-layer", "methods")
    'craft-layer'
    >>> try:
    ...     path_component("../x", "methods")
    ... except ValueError as e:  # a ConfigError
    ...     print(e)
    methods: '../x' cannot name a file or folder (it holds '/', a path separator)
    """
    if not isinstance(name, str):
        raise ConfigError(f"{field}: {name!r} cannot name a file or folder (it is not "
                          f"text but {type(name).__name__})")
    why = _why_not(name)
    if why is not None:
        shown = name if len(name) <= 80 else name[:77] + "…"
        raise ConfigError(f"{field}: {shown!r} cannot name a file or folder ({why})")
    return name
