"""The method table: every compression method, by the name users call it.

One line per method. The ``Compression`` namespaces of both adapters, the examples' flags and
the benchmarks read this table; a new method is its core module, one line here, its tests and
its section of ``docs/algorithms.md``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Type

from . import wire
from .blocksign import BlockSign, BlockSignConfig
from .config import CompressionConfig, GatheredConfig
from .dgc import DGC, DGCConfig
from .gaussiank import GaussianK, GaussianKConfig
from .method import Method
from .scalecom import ScaleCom, ScaleComConfig
from .sparse_allreduce import aggregated
from .topk import TopK, TopKConfig


@dataclass(frozen=True)
class MethodSpec:
    """One method of the table.

    Attributes:
        name: the factory's name (``Compression.<name>``) and the examples' flag value.
        method: the core class.
        config: the frozen dataclass of its options, every default included.
        momentum_in_compressor: the method has a ``momentum`` option of its own: the fused
            optimizer moves SGD's momentum (and what else of SGD's the config has: Nesterov,
            weight decay) into it, and the examples give the momentum there. Whether a given
            config then refuses optimizers with state of their own is
            :attr:`CompressionConfig.needs_plain_optimizer`.
        summary: one line for help texts.
    """

    name: str
    method: Type[Method]
    config: Type[CompressionConfig]
    momentum_in_compressor: bool
    summary: str

    @property
    def takes_density(self) -> bool:
        """Whether the options include a ``density`` (the sparse selections do)."""
        return any(f.name == "density" for f in dataclasses.fields(self.config))

    @property
    def factory_doc(self) -> str:
        """The docstring of both adapters' ``Compression.<name>`` factory."""
        return (f"{self.summary[0].upper()}{self.summary[1:]}; options: "
                f":class:`~{self.config.__module__}.{self.config.__name__}`. "
                f"``hierarchical=True``: average densely inside each host and compress "
                f"between hosts only (:mod:`horovod_dgc.core.hosts`).")

    def build(self, world_size: Optional[int] = None, **options: Any) -> Method:
        """The method with these options (validated by its config), exchanged as its
        ``aggregation`` option says, if it has one (``"auto"`` picks by ``world_size``).
        The result's ``family`` (sparse or two-stage) says how a tensor is exchanged."""
        method = self.method(self.config(**options))
        if isinstance(method.config, GatheredConfig):
            return aggregated(method, world_size)
        return method


METHODS: Tuple[MethodSpec, ...] = (
    MethodSpec("dgc", DGC, DGCConfig, True,
               "Deep Gradient Compression: momentum correction, sampled exact top-k"),
    MethodSpec("topk", TopK, TopKConfig, False, "exact top-k with error feedback"),
    MethodSpec("gaussiank", GaussianK, GaussianKConfig, False,
               "Gaussian-k: threshold from mean and standard deviation, error feedback"),
    MethodSpec("scalecom", ScaleCom, ScaleComConfig, False,
               "ScaleCom: the leader's top-k indices, values all-reduced"),
    MethodSpec("blocksign", BlockSign, BlockSignConfig, True,
               "blockwise scaled 1-bit signs with worker and server error feedback"),
)

BY_NAME: Mapping[str, MethodSpec] = {spec.name: spec for spec in METHODS}
BY_CLASS: Mapping[str, MethodSpec] = {spec.method.__name__: spec for spec in METHODS}


def _check_unique() -> None:
    ids: Dict[int, str] = {}
    for spec in METHODS:
        other = ids.setdefault(spec.method.method_id, spec.name)
        if other != spec.name:
            raise RuntimeError(f"methods {other} and {spec.name} share method id "
                               f"{spec.method.method_id}")
    if len(BY_NAME) != len(METHODS) or len(BY_CLASS) != len(METHODS):
        raise RuntimeError("two methods of the table share a name or a class")
    wire.METHOD_NAMES.update(ids)


_check_unique()


def spec_of(method: Method) -> MethodSpec:
    """The table line of a method object."""
    return BY_CLASS[method.table_class]


def from_saved(method_class: str, config: Mapping[str, Any], world_size: Optional[int] = None) -> Method:
    """The method a saved state names (its class name and config fields; ``world_size``:
    the workers it will run among, for ``aggregation="auto"``)."""
    spec = BY_CLASS.get(method_class)
    if spec is None:
        raise ValueError(f"compressor state is from an unknown method {method_class!r}")
    return spec.build(world_size, **{key: tuple(value) if isinstance(value, list) else value
                         for key, value in config.items()})
