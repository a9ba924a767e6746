"""What the collectors' settings share (their models live in ``producers/<source>/config.py``).

``GPU_RESOURCES`` is the one default list of GPU-like extended resources, used by both the
scheduler collector (which pods are GPU pods) and the pod-resources collector (which
devices to publish): with defaults, a pod the one sees is a pod the other records.
``ResourceMatcher`` is the one way such a list is matched (a trailing ``*`` is a prefix).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_settings import NoDecode


def _comma_list(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


#: Names given comma-separated in the environment (``a, b``) or as a list by flags.
NameList = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_comma_list)]


#: GPU-like extended resources, the default of both collectors: NVIDIA's device plugin
#: (whole GPUs; time-slicing with ``renameByDefault`` -> ``.shared``; MIG's mixed strategy
#: ``nvidia.com/mig-<profile>``, e.g. ``mig-1g.10gb``, and its ``.shared`` form), AMD's
#: device plugin, Intel's GPU plugin (``gpu.intel.com/i915``, ``/xe``).
GPU_RESOURCES: tuple[str, ...] = ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*", "amd.com/gpu", "gpu.intel.com/*")


#: DRA drivers whose devices are GPUs, the default of both collectors: NVIDIA's
#: (``gpu.nvidia.com``; MIG devices are published by the same driver), AMD's, Intel's.
GPU_DRA_DRIVERS: tuple[str, ...] = ("gpu.nvidia.com", "gpu.amd.com", "gpu.intel.com")


def dra_device_id(driver: str, pool: str, device: str) -> str:
    """The one text of a DRA device: ``<driver>/<pool>/<device>`` (the triplet that names it
    uniquely, as the kubelet's pod-resources API and a ResourceSlice report it)."""
    return f"{driver}/{pool}/{device}"


def check_resource_patterns(value: tuple[str, ...]) -> tuple[str, ...]:
    """A field validator's check of a resource pattern list: not empty, '*' only at the end."""
    if not value:
        raise ValueError("give at least one resource name")
    bad = [v for v in value if "*" in v[:-1] or v == "*"]
    if bad:
        raise ValueError(f"'*' is only allowed at the end of a name prefix, got {', '.join(bad)}")
    return value


class ResourceMatcher:
    """Configured resource names; an entry ending in '*' is a prefix."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(patterns)
        self.names = frozenset(p for p in self.patterns if not p.endswith("*"))
        self.prefixes = tuple(p[:-1] for p in self.patterns if p.endswith("*"))

    def __call__(self, resource_name: str) -> bool:
        return resource_name in self.names or resource_name.startswith(self.prefixes)

    def select(self, names: Iterable[str]) -> list[str]:
        """The names (e.g. a container's requests/limits keys) that match, in order, once each."""
        return sorted({n for n in names if isinstance(n, str) and self(n)})
