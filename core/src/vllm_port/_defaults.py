"""Core's own plugin: the default comm parts, block pool and migrator every platform gets unless a plugin replaces one.

Registered before any vendor plugin and marked ``trylast``, so a vendor's answer always wins.
"""

from __future__ import annotations

from .comm import Collectives, PointToPoint, TorchCollectives, TorchPointToPoint
from .hookspecs import hookimpl
from .memory import BlockPoolFactory, Migrator, TorchMigrator, default_block_pool_factory
from .platform import PlatformDescription


@hookimpl(trylast=True)
def vllm_port_point_to_point(platform: PlatformDescription) -> PointToPoint:
    return TorchPointToPoint()


@hookimpl(trylast=True)
def vllm_port_collectives(platform: PlatformDescription) -> Collectives:
    return TorchCollectives()


@hookimpl(trylast=True)
def vllm_port_block_pool(platform: PlatformDescription) -> BlockPoolFactory:
    return default_block_pool_factory


@hookimpl(trylast=True)
def vllm_port_migrator(platform: PlatformDescription) -> Migrator:
    return TorchMigrator()
