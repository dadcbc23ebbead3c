"""The OpenAI server's Prometheus metrics (``GET /metrics``), in a registry of their own so that two
servers in one process (tests) do not share them."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

# seconds: a CPU step of a small model takes milliseconds, a first token after a long queue seconds
_STEP = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("knnssd_requests", "Requests answered, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("knnssd_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("knnssd_completion_tokens", "Tokens delivered to clients", registry=r)
        self.drafted = Counter("knnssd_drafted_tokens", "Tokens drafted for verification", registry=r)
        self.accepted = Counter("knnssd_accepted_tokens", "Drafted tokens the full model accepted", registry=r)
        self.steps = Counter("knnssd_steps", "Batched verification steps (one full-model pass each)", registry=r)
        self.queue = Gauge("knnssd_queue_depth", "Requests waiting for a slot", registry=r)
        self.active = Gauge("knnssd_active_slots", "Sequences being decoded", registry=r)
        self.step_s = Histogram("knnssd_step_seconds", "Seconds of one batched step's pass", buckets=_STEP,
                                registry=r)
        self.ttft_s = Histogram("knnssd_time_to_first_token_seconds", "From request to its first token",
                                buckets=_LATENCY, registry=r)
        self.itl_s = Histogram("knnssd_inter_token_latency_seconds", "Between a request's tokens (a step's "
                               "tokens share its wait)", buckets=_STEP, registry=r)
        self.served = Info("knnssd_served", "The bank version being served", registry=r)

    def step(self, pass_s: float, active: int, drafted: int, emitted: int) -> None:
        """One batched step (the batch's thread)."""
        self.steps.inc()
        self.step_s.observe(pass_s)
        self.drafted.inc(drafted)
        self.accepted.inc(max(0, emitted - active))  # each sequence's step emits one token beyond its accepted ones

    def text(self) -> bytes:
        return generate_latest(self.registry)
