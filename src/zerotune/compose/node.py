"""The schema (zerotune/schema) as OmegaConf's node: registered in Hydra's ConfigStore as conf/config.yaml's
`zerotune_schema`, and the way from a node, or plain data, to the frozen `Config`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from zerotune.schema import Config


def structured() -> DictConfig:
    """The schema as a config Hydra can compose into. The dataclasses are frozen (a resolved run's config is
    never changed), which OmegaConf carries over as read-only nodes; composition must write into them
    (defaults, then overrides), so the nodes are made writable here."""
    node = OmegaConf.structured(Config)

    def writable(container: DictConfig) -> None:
        OmegaConf.set_readonly(container, None)
        for key in container:
            child = container._get_node(key)  # the node itself: reading it as a value would resolve it
            if isinstance(child, DictConfig):
                writable(child)

    writable(node)
    return node


def register() -> None:
    """Make `zerotune_schema` available to conf/config.yaml's defaults list."""
    ConfigStore.instance().store(name="zerotune_schema", node=structured())


def typed(cfg: DictConfig | Mapping[str, Any]) -> DictConfig:
    """A plain config (a run's config.yaml) with the schema's types again, still a DictConfig."""
    return OmegaConf.merge(structured(), cfg)  # type: ignore[return-value]


def to_config(cfg: DictConfig | Mapping[str, Any]) -> Config:
    """The composed config (Hydra's DictConfig, or plain data: a run's resolved.json) as the schema's frozen
    dataclasses: what every function past the command line is given. Interpolations are resolved here, once."""
    node = cfg if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is Config else typed(cfg)
    return OmegaConf.to_object(node)  # type: ignore[return-value]
