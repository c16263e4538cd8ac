"""The LiteLLM strategy's logic without LiteLLM: deployments as backends, exclusions, outcome mapping."""

from __future__ import annotations

import datetime as dt
import random

from llmdiag.config.balancer import BalancerConfig, ScoreConfig
from llmdiag.gateway.litellm_strategy import LlmdiagRouting, _backend_url, _failure_status
from llmdiag.model import BackendState


def _deployments(n: int = 3) -> list[dict]:
    return [{"model_name": "llama", "model_info": {"id": f"dep-{i}"},
             "litellm_params": {"model": "openai/m", "api_base": f"http://10.0.0.{i}:8000/v1"}} for i in range(n)]


def _routing() -> LlmdiagRouting:
    return LlmdiagRouting(None, balancer_config=BalancerConfig(score=ScoreConfig(warming_start_score=100.0)),
                          rng=random.Random(1))


class Quota(Exception):
    status_code = 429


def test_backend_url_from_api_base() -> None:
    assert _backend_url(_deployments()[1]) == "http://10.0.0.1:8000"
    assert _backend_url({"litellm_params": {"api_base": "https://api.example.com/v1"}}) == "https://api.example.com:443"
    assert _backend_url({"litellm_params": {"model": "gpt-4o"}}) == "https://hosted.invalid:443"


def test_cooled_and_previously_failed_deployments_are_excluded() -> None:
    routing = _routing()
    deps = _deployments()
    kwargs = {"metadata": {"previous_models": [{"deployment_id": "dep-1", "exception_type": "APIConnectionError"}]}}
    for _ in range(30):
        chosen = routing.choose("llama", [{"role": "user", "content": "hi"}], None, kwargs, deps, cooled=["dep-0"])
        assert chosen["model_info"]["id"] == "dep-2"
        routing.record_success({"litellm_params": {"model_info": {"id": "dep-2"}}}, None, None)
    assert routing.cooled_down_skipped_total == 30 and routing.previous_skipped_total == 30
    assert routing.balancer.load("dep-2") == 0  # every pick got its on_finish


def test_everything_excluded_falls_back_instead_of_refusing() -> None:
    routing = _routing()
    deps = _deployments(2)
    chosen = routing.choose("llama", None, "some input", None, deps, cooled=["dep-0", "dep-1"])
    assert chosen in deps and routing.fallbacks_total == 1


def test_outcomes_map_to_balancer_feedback() -> None:
    routing = _routing()
    deps = _deployments(2)
    routing.choose("llama", None, None, None, deps, cooled=[])
    start = dt.datetime(2026, 1, 1)
    routing.record_success({"litellm_params": {"model_info": {"id": "dep-0"}}, "stream": True,
                            "completion_start_time": start + dt.timedelta(seconds=0.25)}, start, start)
    assert routing.balancer.counters["responses_ok_total"] == 1
    kv = Quota("litellm.RateLimitError: KV cache exhausted, no free blocks")
    quota = Quota("litellm.RateLimitError: Rate limit exceeded for api key sk-1")
    routing.record_failure({"litellm_params": {"model_info": {"id": "dep-0"}}, "exception": quota})
    assert routing.balancer.state("dep-0") is not BackendState.COOLING
    routing.record_failure({"litellm_params": {"model_info": {"id": "dep-1"}}, "exception": kv})
    assert routing.balancer.state("dep-1") is BackendState.COOLING
    assert _failure_status({"standard_logging_object": {"error_information": {
        "normalized_error": "500_PROVIDER_CONNECTION_ERROR"}}}, RuntimeError("x"))[0] == "connect_error"
    # Feedback for a deployment the strategy does not know is ignored, not an error.
    routing.record_failure({"litellm_params": {"model_info": {"id": "other"}}, "exception": kv})
