"""An example fedloom plug-in (see examples/plugin/pyproject.toml)."""
