"""router_feedback: the scoring balancer and what feeds it (SPEC section 6; docs/balancer.md).

``balancer`` (the public API) over ``routing`` (the hot path), ``prefill_speed``,
``health``, ``breaker``, ``score``, ``errors``, ``signals`` and ``report``; active
health in ``probes``, retries in ``retry``, exporter weights in ``weights``, node
agents' penalties in ``agent_penalties``, the micro-benchmark in ``benchmark``.
The exporters and the gateway that use it live in their own packages.
"""
