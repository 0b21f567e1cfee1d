"""A real Prometheus (Debian's binary) that scrapes a local Ray's metrics ports, for tests.

It reads the targets from the service-discovery file Ray's dashboard writes in the
session's folder, as a user's Prometheus would (docs/observability.rst); its data, config
and process go when :meth:`Prometheus.stop` runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Any

BINARY = "prometheus"
CONFIG = """\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: ray
    file_sd_configs:
      - files: ['{sd_file}']
        refresh_interval: 1s
"""


class Prometheus:
    """Starts Prometheus on a free loopback port, scraping the targets in ``sd_file``."""

    def __init__(self, sd_file: str) -> None:
        if shutil.which(BINARY) is None:
            raise RuntimeError("prometheus is not installed: `make prometheus` installs Debian's")
        self.folder = tempfile.mkdtemp(prefix="horovod_ray-prometheus-")
        config = os.path.join(self.folder, "prometheus.yml")
        with open(config, "w") as handle:
            handle.write(CONFIG.format(sd_file=sd_file))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._log = open(os.path.join(self.folder, "log"), "wb")
        self._process = subprocess.Popen(
            [
                shutil.which(BINARY),
                f"--config.file={config}",
                f"--storage.tsdb.path={self.folder}/data",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1)
                return
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    log = self.log()
                    self.stop()
                    raise RuntimeError(f"Prometheus did not start: {log[-2000:]}") from None
                time.sleep(0.2)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant query's series: each ``{"metric": labels, "value": [t, "v"]}``."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.load(answer)
        if body["status"] != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def wait_for(self, expr: str, predicate, timeout_s: float = 60) -> list[dict[str, Any]]:
        """Queries ``expr`` until ``predicate(series)`` holds; the series then.

        Raises:
            AssertionError: It did not hold within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            series = self.query(expr)
            if predicate(series):
                return series
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr} never held within {timeout_s:g}s: {series}")
            time.sleep(0.5)

    def log(self) -> str:
        with open(os.path.join(self.folder, "log"), "rb") as handle:
            return handle.read().decode(errors="replace")

    def stop(self) -> None:
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def value(series: dict[str, Any]) -> float:
    return float(series["value"][1])
