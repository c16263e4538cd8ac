"""Routing policies under test in the cluster simulator.

Every policy sees the cluster the way its real counterpart does:

- ``gw.in_flight[i]`` / ``gw.pending_prefill[i]``: the gateway's own counts
  (requests dispatched and not finished; prompt tokens dispatched and still
  waiting for their first token);
- ``gw.scraped[i]``: the engine's ``/metrics`` as of the last scrape
  (:class:`Scraped`; stale by up to the scrape interval);
- feedback calls: ``on_first_token`` (gateway-observed TTFT, from dispatch),
  ``on_finish`` (status, body, headers), and for llmdiag ``on_penalty`` (the
  node agents' penalties, delayed).

Only the ``oracle`` reference reads the engines' true state.

Peers and where their defaults come from (docs/simulator.md has the longer story):

- ``round_robin``: nginx/HAProxy ``roundrobin`` with equal weights.
- ``least_conn``: HAProxy ``leastconn`` (fewest in-flight, ties broken at random).
- ``envoy_lr``: Envoy ``LEAST_REQUEST`` with ``choice_count`` 2 (its default): two
  hosts drawn with replacement, the one with fewer active requests wins, the
  first on a tie (equal weights, so ``active_request_bias`` does not matter).
- ``peak_ewma``: Envoy's contrib Peak EWMA (after Finagle/linkerd/tower): P2C on
  ``cost = rtt_ewma * (active + 1)``, the EWMA jumping up to any higher sample and
  decaying with ``exp(-dt/decay)``, decay 10 s; a host with no sample yet costs as
  if its RTT were 1 s (tower's default). The RTT sample is the time to first
  byte, which for a streaming completion is the TTFT.
- ``gie``: Gateway API Inference Extension endpoint picker: saturation filter
  (queue < 5 and KV < 0.8; if nobody passes, everyone stays), queue scorer
  (min-max normalised waiting, 1 for the shortest) and KV-cache-utilisation
  scorer (1 - usage), weights 2:2, max-score picker (random among ties), on
  scraped metrics.
- ``litellm``: LiteLLM ``latency-based-routing`` as its code does it (see
  :class:`LiteLLMLatency`: per-token TTFT logged at completion, 10-entry lists,
  unmeasured deployments first, 5 s cooldown past 50 % failures in a minute,
  429 when all are cooling).
- ``llmdiag``: the real :class:`llmdiag.router_feedback.balancer.Balancer`;
  ``llmdiag_no_penalties`` is the same without the node agents' penalties.

References (not peers): ``oracle`` (true state, lowest estimated TTFT) and
``least_pending_prefill`` (fewest gateway-counted prompt tokens awaiting their
first token, then fewest in flight).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from llmdiag.sim.engine_model import EngineModel, SimRequest

__all__ = [
    "PEERS",
    "POLICIES",
    "REFERENCES",
    "GatewayView",
    "NO_DEPLOYMENTS_BODY",
    "Outcome",
    "Policy",
    "Scraped",
    "make_policy",
]

NO_DEPLOYMENTS_BODY = '{"error":{"message":"No deployments available for selected model, all in cooldown","code":429}}'


class Scraped:
    """One engine's metrics as last scraped (``up`` 0 when the scrape failed)."""

    __slots__ = ("waiting", "running", "kv_usage", "kv_capacity_tokens", "preemptions_total", "up", "ts")

    def __init__(self) -> None:
        self.waiting = 0
        self.running = 0
        self.kv_usage = 0.0
        self.kv_capacity_tokens = 0
        self.preemptions_total = 0
        self.up = 1
        self.ts = 0.0


class Outcome:
    """How one attempt ended, as the gateway saw it."""

    __slots__ = ("status", "body", "headers", "kind")

    def __init__(self, status: int | str, body: str = "", headers: dict[str, str] | None = None, kind: str = "ok"):
        self.status = status  # HTTP status, or "timeout" / "connect_error"
        self.body = body
        self.headers = headers or {}
        self.kind = kind  # ok | saturated_429 | client_429 | client_error | server_5xx | connect_error | timeout | lost


class GatewayView:
    """What the gateway knows (shared by the simulator and the policy)."""

    def __init__(self, engines: Sequence[EngineModel]) -> None:
        n = len(engines)
        self.n = n
        self.names = [e.name for e in engines]
        self.in_flight = [0] * n
        self.pending_prefill = [0] * n
        self.scraped = [Scraped() for _ in range(n)]
        self.engines = engines  # true state: only the oracle may read it


class Policy:
    """Base: a policy picks an engine index and hears back what happened."""

    name = "policy"
    needs_scrape = False
    needs_penalties = False

    def __init__(self, gw: GatewayView, rng: random.Random, clock: Callable[[], float]) -> None:
        self.gw = gw
        self.rng = rng
        self.clock = clock

    def pick(self, req: SimRequest, now: float, exclude: frozenset[int]) -> int | None:
        raise NotImplementedError

    def on_dispatch(self, i: int, req: SimRequest, now: float) -> None:
        pass

    def on_first_token(self, i: int, req: SimRequest, ttft: float, now: float) -> None:
        pass

    def on_finish(self, i: int, req: SimRequest, outcome: Outcome, first_token_seen: bool, now: float) -> None:
        pass

    def on_scrape(self, now: float) -> None:
        pass

    def on_penalty(self, i: int, penalty: float, reasons: tuple[Any, ...], now: float) -> None:
        pass

    def on_probe_tick(self, now: float) -> None:
        pass

    def close(self) -> None:
        """Release what the policy holds (an event loop for llmdiag's probes)."""

    def _candidates(self, exclude: frozenset[int]) -> list[int]:
        return [i for i in range(self.gw.n) if i not in exclude]


def _argmin_random(cands: Sequence[int], key: Callable[[int], Any], rng: random.Random) -> int:
    """The candidate with the smallest key; ties broken uniformly at random."""
    best = cands[0]
    best_key = key(best)
    ties = 1
    for i in cands[1:]:
        k = key(i)
        if k < best_key:
            best, best_key, ties = i, k, 1
        elif k == best_key:
            ties += 1
            if rng.random() * ties < 1.0:
                best = i
    return best


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._next = 0

    def pick(self, req: SimRequest, now: float, exclude: frozenset[int]) -> int | None:
        n = self.gw.n
        for _ in range(n):
            i = self._next
            self._next = (i + 1) % n
            if i not in exclude:
                return i
        return None


class LeastConnections(Policy):
    name = "least_conn"

    def pick(self, req: SimRequest, now: float, exclude: frozenset[int]) -> int | None:
        cands = self._candidates(exclude) if exclude else range(self.gw.n)
        if not cands:
            return None
        in_flight = self.gw.in_flight
        return _argmin_random(list(cands), in_flight.__getitem__, self.rng)


class EnvoyLeastRequest(Policy):
    """P2C with replacement on active requests (Envoy ``LEAST_REQUEST``, ``choice_count`` 2)."""

    name = "envoy_lr"
    choice_count = 2

    def pick(self, req: SimRequest, now: float, exclude: frozenset[int]) -> int | None:
        cands = self._candidates(exclude) if exclude else None
        n = len(cands) if cands is not None else self.gw.n
        if n == 0:
            return None
        rnd = self.rng.random
        in_flight = self.gw.in_flight
        best = -1
        for _ in range(self.choice_count):
            k = int(rnd() * n)
            i = cands[k] if cands is not None else k
            if best < 0 or in_flight[i] < in_flight[best]:
                best = i
        return best


class PeakEwma(Policy):
    """P2C on ``rtt_ewma * (active + 1)`` (Envoy contrib Peak EWMA / Finagle)."""

    name = "peak_ewma"
    decay_s = 10.0
    default_rtt_s = 1.0

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        n = self.gw.n
        self.rtt: list[float | None] = [None] * n
        self.stamp = [0.0] * n

    def cost(self, i: int, now: float) -> float:
        rtt = self.rtt[i]
        if rtt is None:
            rtt = self.default_rtt_s
        else:
            dt = now - self.stamp[i]
            if dt > 0:
                # Decay toward zero between samples (Finagle decays the peak the same way).
                rtt *= math.exp(-dt / self.decay_s)
        return rtt * (self.gw.in_flight[i] + 1)

    def pick(self, req: SimRequest, now: float, exclude: frozenset[int]) -> int | None:
        cands = self._candidates(exclude) if exclude else None
        n = len(cands) if cands is not None else self.gw.n
        if n == 0:
            return None
        rnd = self.rng.random
        a = int(rnd() * n)
        b = int(rnd() * n)
        if cands is not None:
            a, b = cands[a], cands[b]
        return a if self.cost(a, now) <= self.cost(b, now) else b

    def on_first_token(self, i: int, req: SimRequest, ttft: float, now: float) -> None:
        old = self.rtt[i]
        if old is None or ttft > old:
            self.rtt[i] = ttft  # peak: jump up at once
        else:
            w = math.exp(-(now - self.stamp[i]) / self.decay_s)
            self.rtt[i] = old * w + ttft * (1.0 - w)
        self.stamp[i] = now


class GieScorer(Policy):
    """GIE endpoint picker: saturation filter, queue + KV scorers 2:2, max-score picker."""

    name = "gie"
    needs_scrape = True
    queue_threshold = 5
    kv_threshold = 0.8
    queue_weight = 2.0
    kv_weight = 2.0

    def pick(self, req: SimRequest, now: float, exclude: frozenset[int]) -> int | None:
        scraped = self.gw.scraped
        cands = [i for i in range(self.gw.n) if i not in exclude and scraped[i].up]
        if not cands:
            cands = self._candidates(exclude)
            if not cands:
                return None
        ok = [i for i in cands if scraped[i].waiting < self.queue_threshold and scraped[i].kv_usage < self.kv_threshold]
        if ok:
            cands = ok
        qs = [scraped[i].waiting for i in cands]
        qmin, qmax = min(qs), max(qs)
        span = qmax - qmin
        best = -1
        best_score = -1.0
        ties = 0
        rnd = self.rng.random
        for i, q in zip(cands, qs):
            queue_score = 1.0 if span == 0 else (qmax - q) / span
            score = self.queue_weight * queue_score + self.kv_weight * (1.0 - scraped[i].kv_usage)
            if score > best_score:
                best, best_score, ties = i, score, 1
            elif score == best_score:
                ties += 1
                if rnd() * ties < 1.0:
                    best = i
        return best


class LiteLLMLatency(Policy):
    """LiteLLM ``latency-based-routing`` and its cooldowns, as the code does it.

    Source: BerriAI/litellm ``litellm/router_strategy/lowest_latency.py`` (@015b9454)
    and ``litellm/router_utils/cooldown_handlers.py`` (@04f21172):

    - a sample is logged when a request *completes*: ``ttft / completion_tokens``
      into the TTFT list and ``duration / completion_tokens`` into the latency list;
    - a list holds 10 (``max_latency_list_size``); when full, LiteLLM keeps its
      first 9 entries and replaces the last one (``lst[:9] + [new]``);
    - a timeout logs 1000.0 into the latency list only;
    - the score of a streaming request is ``sum(ttft list) / len(latency list)``
      (the latency list when the TTFT list is empty); an unused deployment
      counts ``[0]``, i.e. 0, so it is tried first; lowest wins, ties at random
      (``lowest_latency_buffer`` 0);
    - cooldown (5 s, ``DEFAULT_COOLDOWN_TIME_SECONDS``) when more than 50 % of this
      calendar minute's requests to the deployment failed (and it had more than
      one); 429, 5xx and timeouts are all "retryable", so no status cools at once;
    - when every deployment is cooling, LiteLLM answers 429 (no deployments available).
    """

    name = "litellm"
    list_size = 10
    cooldown_s = 5.0
    failure_threshold = 0.5

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        n = self.gw.n
        self.ttfts: list[list[float]] = [[] for _ in range(n)]
        self.latencies: list[list[float]] = [[] for _ in range(n)]
        self.cool_until = [0.0] * n
        self.minute = [-1] * n
        self.ok_this_minute = [0] * n
        self.fail_this_minute = [0] * n
        self.all_cooling = False  # the last pick found every deployment cooling

    def _log(self, lst: list[float], value: float) -> None:
        if len(lst) < self.list_size:
            lst.append(value)
        else:
            lst[-1] = value  # LiteLLM: lst[: size - 1] + [value]

    def score(self, i: int) -> float:
        lat = self.latencies[i]
        if not lat:
            return 0.0
        ttft = self.ttfts[i]
        return (sum(ttft) if ttft else sum(lat)) / len(lat)

    def pick(self, req: SimRequest, now: float, exclude: frozenset[int]) -> int | None:
        cands = [i for i in range(self.gw.n) if i not in exclude and self.cool_until[i] <= now]
        self.all_cooling = not cands
        if not cands:
            return None
        return _argmin_random(cands, self.score, self.rng)

    def _count(self, i: int, ok: bool, now: float) -> None:
        minute = int(now // 60.0)
        if minute != self.minute[i]:
            self.minute[i] = minute
            self.ok_this_minute[i] = 0
            self.fail_this_minute[i] = 0
        if ok:
            self.ok_this_minute[i] += 1
        else:
            self.fail_this_minute[i] += 1

    def on_finish(self, i: int, req: SimRequest, outcome: Outcome, first_token_seen: bool, now: float) -> None:
        if outcome.kind == "ok":
            self._count(i, True, now)
            tokens = max(1, req.output)
            self._log(self.latencies[i], (now - req.dispatched_at) / tokens)
            if req.first_token_at is not None:
                self._log(self.ttfts[i], (req.first_token_at - req.dispatched_at) / tokens)
            return
        self._count(i, False, now)
        if outcome.kind == "timeout":
            self._log(self.latencies[i], 1000.0)
        total = self.ok_this_minute[i] + self.fail_this_minute[i]
        if total > 1 and self.fail_this_minute[i] / total > self.failure_threshold:
            self.cool_until[i] = now + self.cooldown_s


class Oracle(Policy):
    """Reference: reads the engines' true state, lowest estimated TTFT."""

    name = "oracle"

    def pick(self, req: SimRequest, now: float, exclude: frozenset[int]) -> int | None:
        cands = self._candidates(exclude)
        if not cands:
            return None
        engines = self.gw.engines
        prompt = req.prompt
        return _argmin_random(cands, lambda i: engines[i].estimate_ttft(prompt, now), self.rng)


class LeastPendingPrefill(Policy):
    """Reference: fewest dispatched prompt tokens awaiting first token, then fewest in flight."""

    name = "least_pending_prefill"

    def pick(self, req: SimRequest, now: float, exclude: frozenset[int]) -> int | None:
        cands = self._candidates(exclude) if exclude else list(range(self.gw.n))
        if not cands:
            return None
        pp = self.gw.pending_prefill
        fl = self.gw.in_flight
        return _argmin_random(cands, lambda i: (pp[i], fl[i]), self.rng)


PEERS = ("round_robin", "least_conn", "envoy_lr", "peak_ewma", "gie", "litellm")
REFERENCES = ("oracle", "least_pending_prefill")
_CLASSES: dict[str, type[Policy]] = {
    c.name: c
    for c in (RoundRobin, LeastConnections, EnvoyLeastRequest, PeakEwma, GieScorer, LiteLLMLatency, Oracle, LeastPendingPrefill)
}


def _llmdiag_class(name: str) -> type[Policy]:
    from llmdiag.sim.llmdiag_policy import LlmdiagNoPenaltiesPolicy, LlmdiagPolicy

    return LlmdiagPolicy if name == "llmdiag" else LlmdiagNoPenaltiesPolicy


#: llmdiag and its variants (the same balancer, fed differently).
LLMDIAG = ("llmdiag", "llmdiag_no_penalties")
POLICIES = ("llmdiag", *PEERS, *REFERENCES, "llmdiag_no_penalties")


def make_policy(name: str, gw: GatewayView, rng: random.Random, clock: Callable[[], float], **options: Any) -> Policy:
    """Build a policy by name; ValueError names the known ones."""
    if name in LLMDIAG:
        return _llmdiag_class(name)(gw, rng, clock, **options)
    cls = _CLASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return cls(gw, rng, clock)
