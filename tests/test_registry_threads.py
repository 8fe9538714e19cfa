"""The registry under threads: Flower's simulation builds components from two
threads at once (the ClientApp module builds a ``CompressionMod`` when it is
imported while the ServerApp thread builds ``CRAFT``); every thread must see
every built-in, however the first lookups interleave (issue #36, item 5)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Run in a fresh interpreter: the registry's first load happens once per process.
# Eight threads released together by a barrier each build or look up a built-in
# while the first of them is still importing the component modules (seconds:
# torch among them), which is when a thread used to find the registry half full.
SCRIPT = textwrap.dedent("""
    import json, threading
    from fedloom import registry

    assert not registry._loaded, "the registry was loaded before the threads started"
    N = 8
    gate = threading.Barrier(N)
    errors = []

    def work(i):
        gate.wait()
        try:
            if i % 2:
                registry.build("aggregator", "craft", {}, "aggregator")
            else:
                registry.get("compressor", "topk")
                registry.get("feedback", "sapef")
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"errors": errors, "aggregators": registry.available("aggregator")}))
""")


def test_concurrent_first_lookups_all_see_every_builtin():
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                             timeout=300, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["errors"] == []
        assert {"craft", "fedavg", "krum", "median"} <= set(got["aggregators"])


def test_a_component_module_that_looks_up_while_loading_does_not_deadlock():
    """The loading thread's own lookups (a component module imported by the load
    that asks the registry for a name) return instead of waiting on themselves."""
    script = textwrap.dedent("""
        import sys, types
        from fedloom import registry

        mod = types.ModuleType("_lookup_while_loading")
        sys.modules[mod.__name__] = mod
        registry._MODULES = (*registry._MODULES, mod.__name__)
        real = registry.importlib.import_module

        def imp(name):
            if name == mod.__name__:
                registry.available("aggregator")   # re-entrant: must not block
            return real(name)

        registry.importlib = types.SimpleNamespace(import_module=imp,
                                                   metadata=registry.importlib.metadata)
        print("craft" in registry.available("aggregator"))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip() == "True"
