"""Records the catalog's metrics in this process through ``ray.util.metrics``.

Ray's core worker exports them from its node's metrics port (Prometheus, Ray's Grafana).
A failure to record is logged once and never reaches training.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping

from horovod_ray.observe.catalog import BY_NAME

logger = logging.getLogger(__name__)


class Recorder:
    """This process's metrics, each made on first use with ``defaults`` as its labels
    (those of them it has: a job's metric has no rank).

    Args:
        defaults: Label -> value for every metric that has the label.
    """

    def __init__(self, defaults: Mapping[str, str]) -> None:
        self._defaults = dict(defaults)
        self._metrics: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._failed = False

    def relabel(self, **defaults: str) -> None:
        """Changes default labels (a rank's number after an elastic reset)."""
        with self._lock:
            self._defaults.update(defaults)
            for name, metric in self._metrics.items():
                metric.set_default_tags(self._defaults_of(name))

    def set(self, name: str, value: float, **labels: str) -> None:
        """Sets gauge ``name`` to ``value``; ``labels`` beside the defaults."""
        self._record(name, "set", value, labels)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        """Adds ``value`` (nothing when it is not positive) to counter ``name``."""
        if value > 0:
            self._record(name, "inc", value, labels)

    def _record(self, name: str, how: str, value: float, labels: Mapping[str, str]) -> None:
        try:
            getattr(self._metric(name), how)(float(value), tags=dict(labels) or None)
        except Exception:  # noqa: BLE001 - metrics never stop a job
            if not self._failed:
                self._failed = True
                logger.warning(
                    "recording metric %s failed; later failures are not logged", name, exc_info=True
                )

    def _metric(self, name: str) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            with self._lock:
                metric = self._metrics.get(name)
                if metric is None:
                    metric = self._metrics[name] = self._make(name)
        return metric

    def _make(self, name: str) -> Any:
        from ray.util import metrics  # here: a rank without metrics never loads it

        spec = BY_NAME[name]
        kind = metrics.Gauge if spec.kind == "gauge" else metrics.Counter
        metric = kind(name, spec.meaning, tag_keys=spec.labels)
        metric.set_default_tags(self._defaults_of(name))
        return metric

    def _defaults_of(self, name: str) -> dict[str, str]:
        labels = BY_NAME[name].labels
        return {k: v for k, v in self._defaults.items() if k in labels}
