"""Loaded by every Python process of the real-vLLM test (its directory is put on PYTHONPATH by
scripts/test-real-vllm.sh): sets NIXL's progress-thread delay.

nixl 1.5.1's Python API creates every agent with ``pthrDelay = 0`` (nixl_cu1x/_api.py,
``nixl_agent.__init__``), and neither NIXL nor vLLM 0.32 offers a setting for it: the progress
thread then busy-polls a core per agent. On this 2-core machine two agents (P's and D's) take
both cores, and a request that takes well under a second took 22-54 s. With
``KVLEASE_NIXL_PTHR_DELAY_US`` set (the test sets 100), each agent's config gets that delay
instead, just before the agent is made.

With ``KVLEASE_TEST_KV_CORE`` set (the test sets each engine's own core), vLLM's CPU platform
reports that core as the one to reserve for KV transfer (``discover_numa_topology``), so the
NIXL worker pins its thread there instead of the host's last core. On two hosts each engine's
worker has a last core of its own; with P and D on one 2-core host, both workers (and every
thread they start) landed on core 1, and an idle P stepping in a loop while it held a lease
starved D's worker there.

Nothing else changes; without the variables this file does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any, Callable

_DELAY = os.environ.get("KVLEASE_NIXL_PTHR_DELAY_US")
_MODULES = ("nixl_cu12._api", "nixl_cu13._api")


class _Bindings:
    """NIXL's binding module as ``_api`` sees it, with ``nixlAgent`` setting the delay."""

    def __init__(self, real: Any, delay: int) -> None:
        self._real = real
        self._delay = delay

    def nixlAgent(self, name: Any, config: Any) -> Any:  # noqa: N802 - NIXL's name
        config.pthrDelay = self._delay
        return self._real.nixlAgent(name, config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Loader(importlib.abc.Loader):
    """Loads a module as ``inner`` does, then hands it to ``patch``."""

    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[Any], None]) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Has the modules named ``names`` patched by ``patch`` as they are imported."""

    def __init__(self, names: tuple[str, ...], patch: Callable[[Any], None]) -> None:
        self._names = names
        self._patch = patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self._names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self._patch)
        return spec


def _set_delay(module: Any, delay: int) -> None:
    module.nixlBind = _Bindings(module.nixlBind, delay)


def _reserve_core(module: Any, core: int) -> None:
    """vllm.platforms.cpu with ``CpuPlatform.discover_numa_topology`` naming ``core`` only."""
    module.CpuPlatform.discover_numa_topology = classmethod(lambda cls: [[core]])


_KV_CORE = os.environ.get("KVLEASE_TEST_KV_CORE")

if _DELAY:
    sys.meta_path.insert(0, _Finder(_MODULES, lambda m: _set_delay(m, int(_DELAY))))
if _KV_CORE:
    sys.meta_path.insert(0, _Finder(("vllm.platforms.cpu",), lambda m: _reserve_core(m, int(_KV_CORE))))
