"""Engine metric dialects: which exposed metric feeds which llmdiag signal (SPEC Appendix A).

Each :class:`Dialect` lists :class:`Rule` objects. A rule reads one metric
(or a pair) from a parsed scrape and produces one engine signal. Where a
signal has several rules (old and new vLLM names), the first rule whose
metric is present in the scrape wins, so a scrape that carries both
``gpu_cache_usage_perc`` and ``kv_cache_usage_perc`` reads the new one.

Names are compared in *canonical* form (:func:`canonical_name`): every ``:``
becomes ``_``. That one rule accepts ``vllm:x`` (text format 0.0.4),
``vllm_x`` (OpenMetrics sample lines) and ``trtllm:x`` (as Dynamo re-exports
TensorRT-LLM) alike, with or without a counter's ``_total``. Histogram bucket layouts are never hard-coded: they are
read from each scrape.

docs/engines.md reproduces this table for people; keep the two in step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "AGGREGATION",
    "ALLOCATOR_RULES",
    "DIALECTS",
    "UNCOUNTED_HANDLERS",
    "Dialect",
    "Kind",
    "Rule",
    "canonical_name",
    "detect_dialect",
    "response_class",
]


def response_class(status: str) -> str | None:
    """The ``responses_total`` class of an HTTP status as an engine's HTTP counter labels it.

    vLLM's ``http_requests_total`` (prometheus-fastapi-instrumentator) groups statuses as
    ``2xx``/``4xx``/``5xx``; a server set to keep them apart says ``429``, ``503`` ...
    A 429 from the engine itself is saturation (engines have no per-tenant quotas; a
    gateway's quota 429 never reaches them): ``saturated_429``. Any other 4xx (a bad
    request, an unknown model) is the client's doing: ``client_4xx``, left out of error
    ratios. ``None`` for what is not a status.
    """
    code = status.strip().lower()
    if code == "429":
        return "saturated_429"
    if code[:1] == "5":
        return "server_5xx"
    if code[:1] == "4":
        return "client_4xx"
    if code[:1] in ("2", "3"):
        return "ok"
    return None


#: Handlers an engine's HTTP counter counts that are not inference requests (vLLM already
#: leaves out /metrics, /health and friends; /v1/models polls would water error ratios down).
UNCOUNTED_HANDLERS = frozenset({"/v1/models", "/health", "/metrics", "/ping", "/version", "/load", "/server_info"})


def canonical_name(name: str) -> str:
    """``vllm:num_requests_waiting`` and ``vllm_num_requests_waiting`` -> ``vllm_num_requests_waiting``.

    A trailing ``_total`` is dropped too: prometheus_client's text parser
    appends it to counter samples that lack it (Triton's and TGI's counters),
    so ``nv_inference_request_success`` arrives as ``..._success_total``.
    """
    return name.replace(":", "_").removesuffix("_total")


class Kind(enum.Enum):
    GAUGE = "gauge"  # a sample value (selector labels narrow it)
    COUNTER = "counter"  # a cumulative counter; resets handled, emitted as a monotonic _total
    LABELLED_COUNTER = "labelled_counter"  # a counter split by a label (-> Labelled signal)
    LABELLED_GAUGE = "labelled_gauge"  # a gauge split by a label (-> Labelled signal)
    HISTOGRAM = "histogram"  # _bucket/_count/_sum -> Distribution over the window
    HISTOGRAM_SUM_COUNTER = "histogram_sum_counter"  # a histogram's _sum used as a counter (TGI token totals)
    HISTOGRAM_COUNT_COUNTER = "histogram_count_counter"  # a histogram's _count used as a counter (vLLM engine steps)
    MEAN_COUNTERS = "mean_counters"  # cumulative duration counter / cumulative count (Triton core)
    RATIO = "ratio"  # gauge(selector) / gauge(denominator selector)
    PRODUCT = "product"  # gauge(selector) * gauge(second metric/selector)
    INFO_PRODUCT = "info_product"  # product of two numeric labels of an info metric (cache_config_info)
    RESPONSE_CLASSES = "response_classes"  # an HTTP counter by status -> Labelled {class} (response_class())


@dataclass(frozen=True, slots=True)
class Rule:
    """How one signal is read from one dialect.

    ``metric`` is the name as exposed (any spelling; compared canonically).
    ``match`` selects series by label values. ``scale`` converts to base units
    (Triton's microseconds -> seconds). ``source_label`` is the label that
    becomes ``reason`` in a labelled signal; ``fixed_reason`` labels a counter
    that has no such label (SGLang's aborted requests). ``other`` and
    ``other_match`` name the second operand of RATIO, PRODUCT and
    MEAN_COUNTERS (the count), ``labels`` the two labels of INFO_PRODUCT.
    """

    signal: str
    kind: Kind
    metric: str
    match: tuple[tuple[str, str], ...] = ()
    scale: float = 1.0
    source_label: str | None = None
    fixed_reason: str | None = None
    other: str | None = None
    other_match: tuple[tuple[str, str], ...] = ()
    labels: tuple[str, str] | None = None

    @property
    def canonical(self) -> str:
        return canonical_name(self.metric)

    @property
    def canonical_other(self) -> str | None:
        return canonical_name(self.other) if self.other else None


@dataclass(frozen=True, slots=True)
class Dialect:
    """One engine's metric names. ``engine_label`` names the data-parallel engine (if the engine has one)."""

    engine: str  # a Backend.engine kind
    prefixes: tuple[str, ...]  # canonical name prefixes that identify it
    engine_label: str | None
    rules: tuple[Rule, ...]


#: How per-engine values combine into the backend value, and how series of
#: one engine combine (several ``model_name`` series, Triton models):
#: ``max`` for saturation (one full engine is a full backend for the requests
#: routed to it, so an average would hide it), ``sum`` for queue counts,
#: capacities and counters. Distributions merge their window histograms
#: (request-weighted p50/p99, summed count) and take the worst engine's EWMA.
AGGREGATION: dict[str, str] = {
    "requests_waiting": "sum",
    "requests_waiting_by_reason": "sum",
    "requests_running": "sum",
    "requests_paused": "sum",
    "kv_cache_usage": "max",
    "kv_capacity_tokens": "sum",
    "preemptions_total": "sum",
    "requests_finished_total": "sum",
    "responses_total": "sum",
    "prompt_tokens_total": "sum",
    "generation_tokens_total": "sum",
    "engine_steps_total": "sum",
    "ttft_seconds": "distribution",
    "itl_seconds": "distribution",
    "e2e_seconds": "distribution",
    "queue_time_seconds": "distribution",
    "allocator_reserved_bytes": "sum",
    "allocator_allocated_bytes": "sum",
    "allocator_inactive_split_bytes": "sum",
    "allocator_alloc_retries_total": "sum",
    "allocator_ooms_total": "sum",
    "allocator_fragmentation_ratio": "max",
}

G, C, LC, LG, H = Kind.GAUGE, Kind.COUNTER, Kind.LABELLED_COUNTER, Kind.LABELLED_GAUGE, Kind.HISTOGRAM

#: The optional in-process allocator exporter (llmdiag.collectors.allocator_exporter), registered
#: on the engine's own registry, so any dialect's scrape may carry it. Its series have no
#: data-parallel engine label: they land on the default engine and are summed over devices.
#: ``allocator_fragmentation_ratio`` = inactive_split / reserved is the only honest
#: fragmentation measure (NVML cannot see inside the caching allocator).
ALLOCATOR_RULES: tuple[Rule, ...] = (
    Rule("allocator_reserved_bytes", G, "llmdiag_allocator_reserved_bytes"),
    Rule("allocator_allocated_bytes", G, "llmdiag_allocator_allocated_bytes"),
    Rule("allocator_inactive_split_bytes", G, "llmdiag_allocator_inactive_split_bytes"),
    Rule("allocator_alloc_retries_total", C, "llmdiag_allocator_alloc_retries_total"),
    Rule("allocator_ooms_total", C, "llmdiag_allocator_ooms_total"),
    Rule("allocator_fragmentation_ratio", Kind.RATIO, "llmdiag_allocator_inactive_split_bytes",
         other="llmdiag_allocator_reserved_bytes"),
)

VLLM = Dialect(
    engine="vllm",
    prefixes=("vllm_",),
    engine_label="engine",
    rules=(
        Rule("requests_waiting", G, "vllm:num_requests_waiting"),
        # Since 2026-03: waiting split into capacity (KV full) and deferred.
        Rule("requests_waiting_by_reason", LG, "vllm:num_requests_waiting_by_reason", source_label="reason"),
        Rule("requests_running", G, "vllm:num_requests_running"),
        Rule("kv_cache_usage", G, "vllm:kv_cache_usage_perc"),
        Rule("kv_cache_usage", G, "vllm:gpu_cache_usage_perc"),  # V0 / early V1 name, since removed
        Rule("kv_capacity_tokens", Kind.INFO_PRODUCT, "vllm:cache_config_info", labels=("num_gpu_blocks", "block_size")),
        Rule("preemptions_total", C, "vllm:num_preemptions_total"),
        Rule("ttft_seconds", H, "vllm:time_to_first_token_seconds"),
        Rule("itl_seconds", H, "vllm:inter_token_latency_seconds"),
        Rule("itl_seconds", H, "vllm:time_per_output_token_seconds"),  # older name
        Rule("e2e_seconds", H, "vllm:e2e_request_latency_seconds"),
        Rule("queue_time_seconds", H, "vllm:request_queue_time_seconds"),
        Rule("requests_finished_total", LC, "vllm:request_success_total", source_label="finished_reason"),
        Rule("prompt_tokens_total", C, "vllm:prompt_tokens_total"),
        Rule("generation_tokens_total", C, "vllm:generation_tokens_total"),
        # One observation per engine step (tokens in that step): its count is the steps taken, the
        # progress signal engine_stalled reads. Other engines count tokens only at a request's end.
        Rule("engine_steps_total", Kind.HISTOGRAM_COUNT_COUNTER, "vllm:iteration_tokens_total"),
        # The API server's own count of answers by status (no engine label: DP engine "0").
        Rule("responses_total", Kind.RESPONSE_CLASSES, "http_requests_total", source_label="status"),
    ),
)

SGLANG = Dialect(
    engine="sglang",
    prefixes=("sglang_",),
    engine_label="dp_rank",
    rules=(
        Rule("requests_waiting", G, "sglang:num_queue_reqs"),
        Rule("requests_running", G, "sglang:num_running_reqs"),
        Rule("kv_cache_usage", G, "sglang:token_usage"),
        Rule("kv_capacity_tokens", Kind.INFO_PRODUCT, "sglang:cache_config_info", labels=("num_pages", "page_size")),
        Rule("kv_capacity_tokens", G, "sglang:max_total_num_tokens"),
        # The counter (newer SGLang). The older gauge sglang:num_retracted_reqs is a
        # per-interval count, not a total: it is not turned into a made-up counter.
        Rule("preemptions_total", C, "sglang:num_retracted_requests_total"),
        Rule("ttft_seconds", H, "sglang:time_to_first_token_seconds"),
        Rule("itl_seconds", H, "sglang:inter_token_latency_seconds"),
        Rule("itl_seconds", H, "sglang:time_per_output_token_seconds"),
        Rule("e2e_seconds", H, "sglang:e2e_request_latency_seconds"),
        Rule("queue_time_seconds", H, "sglang:queue_time_seconds"),
        Rule("requests_finished_total", LC, "sglang:num_aborted_requests_total", fixed_reason="abort"),
        Rule("prompt_tokens_total", C, "sglang:prompt_tokens_total"),
        Rule("generation_tokens_total", C, "sglang:generation_tokens_total"),
    ),
)

TRTLLM_SERVE = Dialect(
    engine="trtllm",
    prefixes=("trtllm_",),
    engine_label=None,
    rules=(
        Rule("requests_waiting", G, "trtllm_num_requests_waiting"),
        Rule("requests_running", G, "trtllm_num_requests_running"),
        Rule("kv_cache_usage", G, "trtllm_kv_cache_utilization"),
        Rule("kv_capacity_tokens", Kind.PRODUCT, "trtllm_kv_cache_max_blocks", other="trtllm_kv_cache_tokens_per_block"),
        Rule("requests_paused", G, "trtllm_num_paused_requests"),
        Rule("ttft_seconds", H, "trtllm_time_to_first_token_seconds"),
        Rule("itl_seconds", H, "trtllm_time_per_output_token_seconds"),
        Rule("e2e_seconds", H, "trtllm_e2e_request_latency_seconds"),
        Rule("queue_time_seconds", H, "trtllm_request_queue_time_seconds"),
        Rule("requests_finished_total", LC, "trtllm_request_success_total", source_label="finished_reason"),
        Rule("prompt_tokens_total", C, "trtllm_prompt_tokens_total"),
        Rule("generation_tokens_total", C, "trtllm_generation_tokens_total"),
    ),
)

#: Triton core's cumulative counters, on every Triton /metrics (its TensorRT-LLM backend included).
_TRITON_CORE_RULES: tuple[Rule, ...] = (
    Rule("e2e_seconds", Kind.MEAN_COUNTERS, "nv_inference_request_duration_us", scale=1e-6,
         other="nv_inference_request_success"),
    Rule("queue_time_seconds", Kind.MEAN_COUNTERS, "nv_inference_queue_duration_us", scale=1e-6,
         other="nv_inference_request_success"),
    Rule("requests_finished_total", LC, "nv_inference_request_success", fixed_reason="ok"),
    Rule("requests_finished_total", LC, "nv_inference_request_failure", source_label="reason"),
)

_KV = "nv_trt_llm_kv_cache_block_metrics"
_REQ = "nv_trt_llm_request_metrics"

#: TensorRT-LLM served by Triton's tensorrtllm backend. The same /metrics also
#: carries Triton core's nv_inference_* series, which give the latency means.
TRTLLM_TRITON = Dialect(
    engine="trtllm",
    prefixes=("nv_trt_llm_",),
    engine_label="model",  # Triton serves several models; each is kept apart
    rules=(
        Rule("requests_waiting", G, _REQ, match=(("request_type", "waiting"),)),
        Rule("requests_running", G, _REQ, match=(("request_type", "scheduled"),)),
        Rule("requests_running", G, _REQ, match=(("request_type", "active"),)),
        Rule("kv_cache_usage", Kind.RATIO, _KV, match=(("kv_cache_block_type", "used"),), other=_KV,
             other_match=(("kv_cache_block_type", "max"),)),
        Rule("kv_cache_usage", G, _KV, match=(("kv_cache_block_type", "fraction"),)),
        Rule("kv_capacity_tokens", Kind.PRODUCT, _KV, match=(("kv_cache_block_type", "max"),), other=_KV,
             other_match=(("kv_cache_block_type", "tokens_per"),)),
        # Paused (preempted) requests in the current iteration: a gauge, so it is
        # requests_paused, not a made-up preemptions_total.
        Rule("requests_paused", G, "nv_trt_llm_inflight_batcher_metrics",
             match=(("inflight_batcher_specific_metric", "paused_requests"),)),
    ) + _TRITON_CORE_RULES,
)

TRITON = Dialect(
    engine="triton",
    prefixes=("nv_inference_",),
    engine_label="model",  # Triton serves several models; each is kept apart
    rules=(
        Rule("requests_waiting", G, "nv_inference_pending_request_count"),
        Rule("ttft_seconds", H, "nv_inference_first_response_histogram_ms", scale=1e-3),
    ) + _TRITON_CORE_RULES,
)

TGI = Dialect(
    engine="tgi",
    prefixes=("tgi_",),
    engine_label=None,
    rules=(
        Rule("requests_waiting", G, "tgi_queue_size"),
        Rule("requests_running", G, "tgi_batch_current_size"),
        Rule("itl_seconds", H, "tgi_request_mean_time_per_token_duration"),
        Rule("e2e_seconds", H, "tgi_request_duration"),
        Rule("queue_time_seconds", H, "tgi_request_queue_duration"),
        Rule("requests_finished_total", LC, "tgi_request_success", fixed_reason="ok"),
        Rule("requests_finished_total", LC, "tgi_request_failure", source_label="err"),
        Rule("prompt_tokens_total", Kind.HISTOGRAM_SUM_COUNTER, "tgi_request_input_length"),
        Rule("generation_tokens_total", Kind.HISTOGRAM_SUM_COUNTER, "tgi_request_generated_tokens"),
    ),
)

#: Detection order matters: a Triton server running the TensorRT-LLM backend
#: exposes both nv_trt_llm_* and nv_inference_*, and is TensorRT-LLM.
DIALECTS: tuple[Dialect, ...] = tuple(
    Dialect(d.engine, d.prefixes, d.engine_label, d.rules + ALLOCATOR_RULES)
    for d in (VLLM, SGLANG, TRTLLM_SERVE, TRTLLM_TRITON, TRITON, TGI)
)

ALL_PREFIXES: tuple[str, ...] = tuple(p for d in DIALECTS for p in d.prefixes)


def detect_dialect(canonical_names: set[str] | frozenset[str], hint: str | None = None) -> Dialect | None:
    """The dialect of a scrape from its canonical sample names (``hint`` = the backend's configured engine)."""
    candidates = [d for d in DIALECTS if any(n.startswith(d.prefixes) for n in canonical_names)]
    if hint:
        for d in candidates:
            if d.engine == hint:
                return d
    return candidates[0] if candidates else None
