"""Network-side rules: cancels, TIME_WAIT, churn, HTTP/2 stalls, retransmits, conntrack."""

from __future__ import annotations

from collections.abc import Iterable

from llmdiag.analyzers.context import Context, number
from llmdiag.analyzers.correlate import Event, Match, coincide
from llmdiag.analyzers.rules.base import Rule, Verdict, bar, ev, reads
from llmdiag.config.analyzers import (
    ClientTimeoutStormConfig,
    ConnectionChurnConfig,
    ConntrackPressureConfig,
    GrpcFlowControlStallConfig,
    NetworkDegradationConfig,
    TimewaitExhaustionConfig,
)
from llmdiag.model import HOST, Evidence, Severity

__all__ = [
    "ClientTimeoutStorm",
    "ConnectionChurn",
    "ConntrackPressure",
    "GrpcFlowControlStall",
    "NetworkDegradation",
    "TimewaitExhaustion",
]


def _counter_events(ctx: Context, backend: str, signal: str, seconds: float, what: str, match: dict[str, str] | None = None) -> list[Event]:
    """Ticks where a (possibly labelled) backend counter rose, as events keyed by the backend
    (``match`` selects label values of a labelled counter)."""
    signals = ctx.snapshot.backends.get(backend, {})
    labels = ctx.labelled(signals, signal)
    out: list[Event] = []
    if labels:
        for key, parsed in labels.items():
            if match and any(parsed.get(k) != v for k, v in match.items()):
                continue
            for ts, amount in ctx.increments("b", backend, f"{signal}{{{key}}}", seconds):
                out.append(Event(ts, backend, what, amount))
    elif match is None:
        for ts, amount in ctx.increments("b", backend, signal, seconds):
            out.append(Event(ts, backend, what, amount))
    return out


#: The clients' cancels as the backend sees them: RST_STREAM(CANCEL) it received. A CANCEL the
#: backend sends is its own doing (it gives up a stream), not a client timing out.
_CLIENT_CANCEL = {"code": "CANCEL", "direction": "received"}


class ClientTimeoutStorm(Rule[ClientTimeoutStormConfig]):
    """Cancels (RST_STREAM code=CANCEL received from the client + TCP peer closes) per second >=
    rate_factor_enter x baseline (and >= min_rate), joined in time (correlate_seconds) with a high
    TTFT on the same backend."""

    kind = "client_timeout_storm"
    history = reads("b", "h2_rst_stream_total", "tcp_peer_closes_total", "ttft_seconds.ewma")
    remediation = "The backend is past its SLO and clients give up: cancelled requests waste GPU; shed load or re-route."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        span = cfg.rate_window_seconds
        for b in ctx.backends:
            signals = ctx.snapshot.backends.get(b, {})
            rates = []
            for key, parsed in ctx.labelled(signals, "h2_rst_stream_total").items():
                if all(parsed.get(k) == v for k, v in _CLIENT_CANCEL.items()):
                    r = ctx.rate("b", b, f"h2_rst_stream_total{{{key}}}", span)
                    if r is not None:
                        rates.append(r)
            if not rates and "h2_rst_stream_total" in signals:
                # The http2 collector watches this gRPC port and labels only the codes it has seen:
                # no CANCEL received yet is a rate of 0, not unknown, so the baseline is learned
                # while the port is healthy (not first from the storm itself).
                rates.append(0.0)
            peer = ctx.rate("b", b, "tcp_peer_closes_total", span)
            if peer is not None:
                rates.append(peer)
            ttft, ttft_base = ctx.ttft(b)
            if not rates:
                yield b, "", None
                continue
            cancel_rate = sum(rates)
            base = ctx.baseline(b, "cancel_rate", cancel_rate)
            ref = base if base is not None else cfg.min_rate
            bar_enter = max(cfg.min_rate, cfg.rate_factor_enter * ref)
            bar_exit = max(cfg.min_rate, cfg.rate_factor_exit * ref)
            ttft_bar = cfg.ttft_high_seconds
            if ttft_base is not None:
                ttft_bar = min(ttft_bar, max(cfg.ttft_ratio * ttft_base, 0.5))
            # Correlate: cancel ticks joined with high-TTFT ticks on the same backend.
            lookback = span + cfg.correlate_seconds
            series = ctx.series("b", b, "ttft_seconds.ewma")
            slow = [] if series is None else [Event(ts, b, "ttft_high", v) for ts, v in series.points_since(ctx.now - lookback) if v >= ttft_bar]
            joined: list[Match] = []
            if slow:  # without a slow tick nothing joins: the cancel events are not worth building
                cancels = _counter_events(ctx, b, "h2_rst_stream_total", span, "cancel", _CLIENT_CANCEL)
                cancels += _counter_events(ctx, b, "tcp_peer_closes_total", span, "peer_close")
                joined = coincide(cancels, slow, cfg.correlate_seconds)
            enter = cancel_rate >= bar_enter and bool(joined)
            stay = cancel_rate >= bar_exit and bool(slow)
            severity = Severity.CRITICAL if base and cancel_rate >= cfg.critical_factor * max(base, cfg.min_rate / cfg.rate_factor_enter) else Severity.WARNING

            def explain() -> tuple[str, list[Evidence]]:
                evidence = [
                    ev("cancels per second (rst_stream CANCEL received + tcp_peer_closes)", cancel_rate, bar(enter, bar_enter, bar_exit), span),
                    ev("cancel rate baseline", base, "warming up" if base is None else None, ctx.config.baseline_seconds),
                    ev("ttft_seconds.ewma", ttft, ttft_bar, cfg.correlate_seconds),
                    ev("cancel ticks joined with high TTFT", float(len(joined)), 1.0, cfg.correlate_seconds),
                ]
                summary = f"clients cancel {cancel_rate:.1f}/s" + (f" ({cancel_rate / base:.0f}x baseline)" if base else "") + (f" while TTFT is {ttft:.2f}s" if ttft is not None else "")
                return summary, evidence

            yield b, "", self.explained(enter, stay, severity, explain, 0.85 if joined else 0.6)


class TimewaitExhaustion(Rule[TimewaitExhaustionConfig]):
    """Per destination ``ip:port``: TIME_WAIT sockets >= fraction_enter of the port range
    (tw / (tw + ephemeral_ports_available)), or port_exhaustion_eta_seconds < eta_enter_seconds."""

    kind = "timewait_exhaustion"
    remediation = "Enable keep-alive/connection pooling to this destination; set net.ipv4.tcp_tw_reuse=1; widen ip_local_port_range."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        for dest, signals in sorted(ctx.snapshot.destinations.items()):
            subject = ctx.backend_at(dest) or HOST
            tw = number(signals.get("timewait_sockets"))
            free = number(signals.get("ephemeral_ports_available"))
            eta = number(signals.get("port_exhaustion_eta_seconds"))
            if tw is None and eta is None:
                yield subject, dest, None
                continue
            fraction = tw / (tw + free) if (tw is not None and free is not None and tw + free > 0) else None
            enter = (fraction is not None and fraction >= cfg.fraction_enter) or (eta is not None and eta < cfg.eta_enter_seconds)
            stay = (fraction is not None and fraction >= cfg.fraction_exit) or (eta is not None and eta < cfg.eta_exit_seconds)
            critical = (fraction is not None and fraction >= cfg.critical_fraction) or (eta is not None and eta < cfg.critical_eta_seconds)

            def explain() -> tuple[str, list[Evidence]]:
                evidence = [ev(f"destinations[{dest}].timewait_sockets", tw, None, None)]
                if fraction is not None:
                    evidence.append(ev(f"destinations[{dest}] TIME_WAIT share of port range", fraction, bar(enter, cfg.fraction_enter, cfg.fraction_exit), None))
                if eta is not None:
                    evidence.append(ev(f"destinations[{dest}].port_exhaustion_eta_seconds", eta, bar(enter, cfg.eta_enter_seconds, cfg.eta_exit_seconds), None))
                rate = number(signals.get("timewait_entry_rate"))
                if rate is not None:
                    evidence.append(ev(f"destinations[{dest}].timewait_entry_rate", rate, None, None))
                summary = f"{'n/a' if tw is None else format(tw, 'g')} sockets in TIME_WAIT to {dest}"
                if fraction is not None:
                    summary += f" ({fraction:.0%} of the port range)"
                if eta is not None:
                    summary += f", ports run out in {eta:.0f}s"
                return summary, evidence

            yield subject, dest, self.explained(enter, stay, Severity.CRITICAL if critical else Severity.WARNING, explain, 0.9)


class ConnectionChurn(Rule[ConnectionChurnConfig]):
    """Connections closed per request >= ratio_enter (no reuse) with a TIME_WAIT entry rate >= tw_rate_enter.

    The TIME_WAIT entry rate is the larger of the backend's own active closes
    (server side, tcp collector) and ``timewait_entry_rate`` of the backend's
    destination ``ip:port`` (clients on this host, timewait collector), found
    with the same address function the collector keys it by."""

    kind = "connection_churn"
    history = reads("b", "tcp_active_closes_total", "tcp_peer_closes_total", "responses_total", "requests_finished_total",
                    "h2_streams_closed_total")
    remediation = "Fix client connection pooling (keep-alive on, MaxIdleConnsPerHost, idle timeouts longer than the request interval)."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        span = cfg.rate_window_seconds
        for b in ctx.backends:
            closes = [r for r in (ctx.rate("b", b, "tcp_active_closes_total", span), ctx.rate("b", b, "tcp_peer_closes_total", span)) if r is not None]
            requests = None
            for signal in ("responses_total", "requests_finished_total", "h2_streams_closed_total"):
                requests = ctx.rate("b", b, signal, span)
                if requests is not None:
                    break
            if not closes or requests is None:
                yield b, "", None
                continue
            close_rate = sum(closes)
            dest = ctx.destination_of(b)
            dest_rate = ctx.destination(dest, "timewait_entry_rate") if dest is not None else None
            tw_rates = [r for r in (ctx.rate("b", b, "tcp_active_closes_total", span), dest_rate) if r is not None]
            tw_rate = max(tw_rates) if tw_rates else None
            ratio = close_rate / requests if requests >= cfg.min_request_rate else None
            enter = ratio is not None and ratio >= cfg.ratio_enter and tw_rate is not None and tw_rate >= cfg.tw_rate_enter
            stay = ratio is not None and ratio >= cfg.ratio_exit

            def explain() -> tuple[str, list[Evidence]]:
                evidence = [
                    ev("connections closed per request", ratio, bar(enter, cfg.ratio_enter, cfg.ratio_exit), span),
                    ev("requests per second", requests, cfg.min_request_rate, span),
                    ev("TIME_WAIT entries per second", tw_rate, cfg.tw_rate_enter, span),
                ]
                summary = f"{ratio:.2f} connections per request at {requests:.1f} req/s: clients do not reuse connections" if ratio is not None else "too few requests to judge connection reuse"
                return summary, evidence

            yield b, "", self.explained(enter, stay, Severity.WARNING, explain, 0.8)


class GrpcFlowControlStall(Rule[GrpcFlowControlStallConfig]):
    """HTTP/2 flow-control stalls followed by RST_STREAM or GOAWAY on the same connection:
    the increase of ``h2_stall_then_reset_total`` over window_seconds >= min_matches.

    The join is done per connection by the http2 collector, which sees each
    frame's connection (pid, fd) and that connection's stall count; the
    snapshot has no per-connection signals, and a join at backend granularity
    would match any stall with any of the routine resets of a busy backend.
    The window ("followed within") is this rule's follow_seconds, handed to the
    collector. ``h2_flow_control_stalls_total`` and ``tcp_sndbuf_full_total`` are
    shown as evidence only.
    """

    kind = "grpc_flow_control_stall"
    history = reads("b", "h2_stall_then_reset_total", "h2_flow_control_stalls_total", "tcp_sndbuf_full_total")
    remediation = "Raise HTTP/2 stream/connection windows; find the slow consumer; check gateway response buffering."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        w = cfg.window_seconds
        for b in ctx.backends:
            if "h2_stall_then_reset_total" not in ctx.snapshot.backends.get(b, {}):
                yield b, "", None
                continue
            matched = ctx.increase("b", b, "h2_stall_then_reset_total", w)
            if matched is None:
                yield b, "", None  # one point: no window yet
                continue
            n = int(matched)
            stalls = ctx.increase("b", b, "h2_flow_control_stalls_total", w)
            sndbuf = ctx.increase("b", b, "tcp_sndbuf_full_total", w)
            severity = Severity.CRITICAL if n >= cfg.critical_matches else Severity.WARNING
            evidence = [
                ev("h2_stall_then_reset_total (increase)", float(n), float(cfg.min_matches), w),
                ev("h2_flow_control_stalls_total (increase)", stalls, None, w),
            ]
            if sndbuf is not None:
                evidence.append(ev("tcp_sndbuf_full_total (increase)", sndbuf, None, w))
            summary = f"{n} stream resets followed a flow-control stall on their connection within {cfg.follow_seconds:g}s"
            yield b, "", self.finding(n >= cfg.min_matches, n >= cfg.min_matches, severity, summary, evidence, 0.85)


class NetworkDegradation(Rule[NetworkDegradationConfig]):
    """Retransmits per send >= retransmit_factor_enter x baseline (and >= the floor), or srtt >=
    srtt_factor_enter x baseline (and >= srtt_floor_seconds)."""

    kind = "network_degradation"
    history = reads("b", "tcp_sends_total", "tcp_retransmits_total")
    remediation = "Check the NIC and the network path (errors, drops, congestion); move traffic away from this backend."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        span = cfg.rate_window_seconds
        for b in ctx.backends:
            sends = ctx.rate("b", b, "tcp_sends_total", span)
            retrans = ctx.rate("b", b, "tcp_retransmits_total", span)
            srtt = ctx.dist(b, "srtt_seconds", "p50")
            ratio = retrans / sends if (sends is not None and retrans is not None and sends >= cfg.min_send_rate) else None
            base_ratio = ctx.baseline(b, "retransmit_ratio", ratio)
            base_srtt = ctx.baseline(b, "srtt", srtt)
            if ratio is None and srtt is None:
                yield b, "", None
                continue
            enter = stay = False
            if ratio is not None:
                ref = base_ratio if base_ratio is not None else cfg.retransmit_ratio_floor
                ratio_enter = max(cfg.retransmit_ratio_floor, cfg.retransmit_factor_enter * ref)
                ratio_exit = max(cfg.retransmit_ratio_floor, cfg.retransmit_factor_exit * ref)
                enter |= ratio >= ratio_enter
                stay |= ratio >= ratio_exit
            srtt_judged = srtt is not None and base_srtt is not None
            if srtt_judged:
                srtt_enter = max(cfg.srtt_floor_seconds, cfg.srtt_factor_enter * base_srtt)
                srtt_exit = max(cfg.srtt_floor_seconds, cfg.srtt_factor_exit * base_srtt)
                enter |= srtt >= srtt_enter
                stay |= srtt >= srtt_exit

            # Built only when read (a diagnosis opens or stays open): the same text and evidence
            # as when they were built for every backend every tick.
            def explain(ratio=ratio, srtt=srtt, base_srtt=base_srtt, srtt_judged=srtt_judged) -> tuple[str, list[Evidence]]:
                evidence = []
                if ratio is not None:
                    evidence.append(ev("retransmits per send", ratio, bar(ratio >= ratio_enter, ratio_enter, ratio_exit), span))
                if srtt_judged:
                    evidence.append(ev("srtt_seconds", srtt, bar(srtt >= srtt_enter, srtt_enter, srtt_exit), None))
                parts = []
                if ratio is not None:
                    parts.append(f"{ratio:.1%} of sends retransmitted")
                if srtt is not None:
                    parts.append(f"srtt {srtt * 1e3:.1f} ms" + (f" ({srtt / base_srtt:.1f}x baseline)" if base_srtt else ""))
                return ", ".join(parts), evidence

            critical = ratio is not None and ratio >= 0.1
            yield b, "", self.explained(enter, stay, Severity.CRITICAL if critical else Severity.WARNING, explain, 0.75)


class ConntrackPressure(Rule[ConntrackPressureConfig]):
    """Host conntrack_entries >= enter x conntrack_max (new connections get dropped when full)."""

    kind = "conntrack_pressure"
    remediation = "Raise net.netfilter.nf_conntrack_max; bypass conntrack (NOTRACK) for backend ports."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        entries, limit = ctx.host("conntrack_entries"), ctx.host("conntrack_max")
        if entries is None or not limit:
            yield HOST, "", None
            return
        usage = entries / limit
        severity = Severity.CRITICAL if usage >= cfg.critical_usage else Severity.WARNING
        level = bar(usage >= cfg.enter, cfg.enter, cfg.exit)
        evidence = [ev("conntrack_entries / conntrack_max", usage, level, None), ev("conntrack_entries", entries, level * limit, None)]
        yield HOST, "", self.finding(usage >= cfg.enter, usage >= cfg.exit, severity, f"conntrack table {usage:.0%} full ({entries:g} of {limit:g})", evidence, 0.95)
