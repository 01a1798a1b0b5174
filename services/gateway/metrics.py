"""Gateway metrics: what the front door saw (outcomes, time to first token) and how often it failed over."""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("k3_gateway_requests_total", "Requests that reached the serving path, by outcome", ["outcome"])
# stage: before_first_token (retried on the backup) or mid_stream (resumed there, or ended retriably).
FAILOVERS = Counter("k3_gateway_failovers_total", "Attempts that failed on a cluster and moved on", ["stage"])
IN_FLIGHT = Gauge("k3_gateway_in_flight", "Requests on the serving path")
TTFT = Histogram("k3_gateway_ttft_seconds", "Serving path start to first token, failovers included",
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
