"""Python request paths that route with the balancer: the OpenAI-compatible proxy and LiteLLM strategy."""
