"""How metrics are named and bucketed, and the `vllm:` aliases of every family.

vLLM's published Grafana dashboard queries `vllm:<name>{model_name="..."}`. fairlane serves the same
names with the same meaning under `fairlane:`; with `metrics_names = "vllm"` the exposition repeats
each family under `vllm:`, so that dashboard works without an edit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

PREFIX = "fairlane:"
VLLM_PREFIX = "vllm:"
MetricsNames = Literal["fairlane", "vllm"]

# vLLM's buckets (vllm/v1/metrics/loggers.py), with finer ones at the low end for inter-token latency
# on an accelerator and for request times of small models (vLLM's request buckets start at 0.3 s);
# every bucket bound of vLLM's is kept, so its quantiles read the same here.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_count_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


@dataclass(slots=True, frozen=True)
class MetricsOptions:
    model_name: str = "default"  # the model_name label of every series: the name clients use
    max_model_len: int = 4096  # the top bucket of the token-count histograms: the model's context
    names: MetricsNames = "fairlane"  # "vllm": every family again under vllm:

    @property
    def alias_prefixes(self) -> tuple[str, ...]:
        return (VLLM_PREFIX,) if self.names == "vllm" else ()


class WithAliases(Collector):
    """A registry's families, then each of them again under every alias prefix."""

    def __init__(self, registry: CollectorRegistry, alias_prefixes: tuple[str, ...]) -> None:
        self._registry = registry
        self._alias_prefixes = alias_prefixes

    def collect(self) -> Iterator[Metric]:
        families = list(self._registry.collect())
        yield from families
        for prefix in self._alias_prefixes:
            for family in families:
                yield renamed(family, prefix)


def renamed(family: Metric, prefix: str) -> Metric:
    """The family and its samples with `fairlane:` replaced by prefix."""
    copy = Metric(prefix + family.name.removeprefix(PREFIX), family.documentation, family.type, family.unit)
    copy.samples = [sample._replace(name=prefix + sample.name.removeprefix(PREFIX)) for sample in family.samples]
    return copy
