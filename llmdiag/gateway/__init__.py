"""Python request paths that use the balancer: the embedded OpenAI-compatible
gateway (:mod:`llmdiag.gateway.proxy`), the LiteLLM routing strategy
(:mod:`llmdiag.gateway.litellm_strategy`) and the trace-replaying load
generator that measures them (:mod:`llmdiag.gateway.loadgen`)."""
