"""What the router's and the workers' metrics share: exposition and bucket ladders. Each app owns
its registry (router/metrics.py, worker/metrics.py), so several apps can live in one process
(tests) without clashing. Names are in the pdserve_ namespace, following vLLM's where the meaning
is the same.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # no *_created samples: they double every counter's lines for nothing
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
