"""The link catalog (sim/data/links.yaml): bandwidth and latency of the links KV crosses between
engines (NVLink, InfiniBand, RoCE, PCIe), one GPU's link each, with the source of each figure.
sim.cluster.links makes LinkSpecs of them; the config checks names against it."""
from __future__ import annotations

from functools import cache
from pathlib import Path

import yaml

LINK_CATALOG = Path(__file__).parent.parent / "data" / "links.yaml"


@cache
def link_catalog() -> dict[str, dict]:
    """name -> bandwidth_gb_s, latency_s, within_node, source."""
    return yaml.safe_load(LINK_CATALOG.read_text())


def link_names() -> list[str]:
    return sorted(link_catalog())
