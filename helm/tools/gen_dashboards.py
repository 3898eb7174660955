"""Generates the Grafana dashboards shipped in helm/loraplex/dashboards/ with grafana-foundation-sdk.

Run `python helm/tools/gen_dashboards.py` after editing; tests/test_dashboards.py checks that the
committed JSON matches this generator, round-trips through the SDK and that every query is valid PromQL.
Every query filters on the $namespace and $pod variables (regex, "All" = ".*"), so the same JSON
works with the chart's ServiceMonitor labels and with a plain static scrape config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as gcommon
from grafana_foundation_sdk.builders import dashboard as gdash
from grafana_foundation_sdk.builders import prometheus as gprom
from grafana_foundation_sdk.builders import stat as gstat
from grafana_foundation_sdk.builders import table as gtable
from grafana_foundation_sdk.builders import timeseries as gts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as mcommon
from grafana_foundation_sdk.models import dashboard as mdash

OUT_DIR = Path(__file__).resolve().parents[1] / "loraplex" / "dashboards"
DS = mdash.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'namespace=~"$namespace", pod=~"$pod"'
RATE = "$__rate_interval"


def q(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> gprom.Dataquery:
    query = gprom.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    if legend:
        query = query.legend_format(legend)
    return query.instant() if instant else query.range()


def targets(*pairs: tuple[str, str]) -> list[gprom.Dataquery]:
    return [q(expr, legend, ref=chr(ord("A") + i)) for i, (expr, legend) in enumerate(pairs)]


def timeseries(title: str, desc: str, unit: str, *pairs: tuple[str, str], span: int = 8) -> gts.Panel:
    return (gts.Panel().title(title).description(desc).datasource(DS).unit(unit).height(8).span(span)
            .fill_opacity(10).targets(targets(*pairs))
            .legend(gcommon.VizLegendOptions().display_mode(mcommon.LegendDisplayMode.LIST)
                    .placement(mcommon.LegendPlacement.BOTTOM).show_legend(True))
            .tooltip(gcommon.VizTooltipOptions().mode(mcommon.TooltipDisplayMode.MULTI)
                     .sort(mcommon.SortOrder.DESCENDING)))


def stat(title: str, desc: str, unit: str, expr: str) -> gstat.Panel:
    return (gstat.Panel().title(title).description(desc).datasource(DS).unit(unit).height(4).span(4)
            .targets([q(expr, instant=True)])
            .graph_mode(mcommon.BigValueGraphMode.AREA).color_mode(mcommon.BigValueColorMode.VALUE)
            .reduce_options(gcommon.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"{by}, le" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return [(f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
             f"{prefix}p{int(p * 100)}") for p in (0.5, 0.9, 0.99)]


def variables(anchor_metric: str) -> list:
    return [
        gdash.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        gdash.QueryVariable("namespace").label("Namespace").datasource(DS)
        .query(f"label_values({anchor_metric}, namespace)")
        .refresh(mdash.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True).all_value(".*").multi(True),
        gdash.QueryVariable("pod").label("Pod").datasource(DS)
        .query(f'label_values({anchor_metric}{{namespace=~"$namespace"}}, pod)')
        .refresh(mdash.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True).all_value(".*").multi(True),
    ]


def base(uid: str, title: str, desc: str, anchor_metric: str) -> gdash.Dashboard:
    return (gdash.Dashboard(title).uid(uid).description(desc).tags(["loraplex"])
            .editable().time("now-1h", "now").refresh("30s").timezone("browser")
            .tooltip(mdash.DashboardCursorSync.CROSSHAIR).variables(variables(anchor_metric)))


def serving() -> gdash.Dashboard:
    d = base("loraplex-serving", "loraplex / LoRA serving",
             "Inference service: LoRA slots and loads, requests, latency, tokens, errors.",
             "loraplex_lora_slots_total")
    d = (d.with_row(gdash.Row("Overview"))
         .with_panel(stat("Inference pods up", "Inference targets answering scrapes.", "none",
                          f'sum(up{{job="loraplex-inference", {SEL}}})'))
         .with_panel(stat("Requests running", "Requests in the running batch, all pods.", "none",
                          f"sum(loraplex_requests_running{{{SEL}}})"))
         .with_panel(stat("Requests waiting", "Queued requests, all pods and reasons.", "none",
                          f"sum(loraplex_requests_waiting{{{SEL}}})"))
         .with_panel(stat("Slots with an adapter", "LoRA slots holding an adapter / all slots.", "percentunit",
                          f"sum(loraplex_lora_slots_occupied{{{SEL}}}) / sum(loraplex_lora_slots_total{{{SEL}}})"))
         .with_panel(stat("KV cache usage", "Mean KV cache block usage across pods.", "percentunit",
                          f"avg(loraplex_kv_cache_usage_ratio{{{SEL}}})"))
         .with_panel(stat("Tokens generated / s", "Generated tokens per second, all pods.", "short",
                          f"sum(rate(loraplex_generation_tokens_total{{{SEL}}}[{RATE}]))")))
    d = (d.with_row(gdash.Row("LoRA slots and loads"))
         .with_panel(timeseries(
             "Slots", "Slot pool: total, holding an adapter, referenced by requests, pinned.", "none",
             (f"sum(loraplex_lora_slots_total{{{SEL}}})", "total"),
             (f"sum(loraplex_lora_slots_occupied{{{SEL}}})", "with adapter"),
             (f"sum(loraplex_lora_slots_referenced{{{SEL}}})", "referenced"),
             (f"sum(loraplex_lora_slots_pinned{{{SEL}}})", "pinned")))
         .with_panel(timeseries(
             "Pending load events", "Host-to-slot copies in flight; should drain within seconds.", "none",
             (f"sum by (pod) (loraplex_lora_pending_load_events{{{SEL}}})", "{{pod}}")))
         .with_panel(timeseries(
             "Loads and evictions / s", "Adapter loads by source tier (cache: host memory, store: cold) and evictions.",
             "ops",
             (f"sum by (tier) (rate(loraplex_lora_loads_total{{{SEL}}}[{RATE}]))", "load {{tier}}"),
             (f"sum(rate(loraplex_lora_evictions_total{{{SEL}}}[{RATE}]))", "evictions")))
         .with_panel(timeseries(
             "Load latency by tier", "Time from needing an adapter to LOADED, by source tier.", "s",
             *quantiles("loraplex_lora_load_seconds", by="tier"), span=16))
         .with_panel(timeseries(
             "Resident adapters", "Adapters by where their weights are (device slot, host memory, adapter cache); "
             "and per adapter, how many pods hold it in a slot (docs/metrics.md).", "none",
             (f"sum by (tier) (loraplex_lora_adapters_resident{{{SEL}}})", "{{tier}}"),
             (f'sum by (adapter) (loraplex_lora_adapter_resident{{{SEL}, tier="device"}})', "pods with {{adapter}}"))))
    d = (d.with_row(gdash.Row("Requests and latency"))
         .with_panel(timeseries(
             "Requests running and waiting", "Running batch and queue, by wait reason.", "none",
             (f"sum(loraplex_requests_running{{{SEL}}})", "running"),
             (f"sum by (reason) (loraplex_requests_waiting{{{SEL}}})", "waiting {{reason}}")))
         .with_panel(timeseries(
             "Time to first token", "TTFT quantiles across pods.", "s",
             *quantiles("loraplex_time_to_first_token_seconds")))
         .with_panel(timeseries(
             "Inter-token latency", "Inter-token latency quantiles across pods.", "s",
             *quantiles("loraplex_inter_token_latency_seconds")))
         .with_panel(timeseries(
             "Tokens / s", "Prompt and generated tokens per second.", "short",
             (f"sum(rate(loraplex_prompt_tokens_total{{{SEL}}}[{RATE}]))", "prompt"),
             (f"sum(rate(loraplex_generation_tokens_total{{{SEL}}}[{RATE}]))", "generated")))
         .with_panel(timeseries(
             "Finished requests / s", "Requests finished, by finish reason.", "reqps",
             (f"sum by (finish_reason) (rate(loraplex_requests_finished_total{{{SEL}}}[{RATE}]))",
              "{{finish_reason}}")))
         .with_panel(timeseries(
             "KV cache usage", "KV cache blocks requests hold, per pod (prefix-cached blocks nobody holds "
             "are not counted).", "percentunit",
             (f"max by (pod) (loraplex_kv_cache_usage_ratio{{{SEL}}})", "{{pod}}")))
         .with_panel(timeseries(
             "Prefix cache hit rate", "Share of looked-up prompt tokens served from the prefix cache "
             "(their KV reused, not computed), all pods.", "percentunit",
             (f"sum(rate(loraplex_prefix_cache_hits_total{{{SEL}}}[{RATE}])) / "
              f"sum(rate(loraplex_prefix_cache_queries_total{{{SEL}}}[{RATE}]))", "hit rate")))
         .with_panel(timeseries(
             "KV cache blocks", "KV blocks by state: held by requests, cached (prefix cache, reusable until "
             "evicted), free; all pods.", "none",
             (f"sum by (state) (loraplex_kv_cache_blocks{{{SEL}}})", "{{state}}"))))
    d = (d.with_row(gdash.Row("Tenants"))
         .with_panel(timeseries(
             "Requests per tenant", "Each tenant's requests streaming and admitted but not yet streaming "
             '(the service labels its top-K tenants by tokens served, the rest as tenant="other").', "none",
             (f"sum by (tenant) (loraplex_tenant_requests_running{{{SEL}}})", "{{tenant}} running"),
             (f"sum by (tenant) (loraplex_tenant_requests_waiting{{{SEL}}})", "{{tenant}} waiting")))
         .with_panel(timeseries(
             "Tokens / s per tenant", "Generated tokens per second per tenant (top-K plus other).", "short",
             (f"sum by (tenant) (rate(loraplex_tenant_generated_tokens_total{{{SEL}}}[{RATE}]))", "{{tenant}}")))
         .with_panel(timeseries(
             "Quota refusals / s", "Requests refused by a tenant quota (RESOURCE_EXHAUSTED / HTTP 429), by "
             "tenant and quota (requests in flight, tokens per minute).", "reqps",
             (f"sum by (tenant, quota) (rate(loraplex_tenant_quota_refusals_total{{{SEL}}}[{RATE}]))",
              "{{tenant}} {{quota}}")))
         .with_panel(timeseries(
             "Preemptions / s", "Running requests preempted, by cause: fair_share (a seat for a tenant below its "
             "share; the request is paused), priority (for a more urgent request), kv_cache (memory; it "
             "recomputes).", "reqps",
             (f"sum by (cause) (rate(loraplex_preemptions_total{{{SEL}}}[{RATE}]))", "{{cause}}"))))
    d = (d.with_row(gdash.Row("Errors and adapters"))
         .with_panel(timeseries(
             "Errors / s (gRPC and HTTP)", "Non-OK gRPC responses by status code and method, and HTTP responses "
             "of 400 and above (refusals such as 400, 404, 413 and 429 included) by status code and route template.",
             "reqps",
             (f'sum by (code, method) (rate(loraplex_grpc_requests_total{{{SEL}, code!="OK"}}[{RATE}]))',
              "gRPC {{code}} {{method}}"),
             (f'sum by (code, route) (rate(loraplex_http_requests_total{{{SEL}, code=~"[45].."}}[{RATE}]))',
              "HTTP {{code}} {{route}}"), span=12))
         .with_panel(timeseries(
             "Requests / s by API", "Every request either API answered, whatever its status: gRPC by method, "
             "HTTP (OpenAI-compatible) by route template.", "reqps",
             (f"sum by (method) (rate(loraplex_grpc_requests_total{{{SEL}}}[{RATE}]))", "gRPC {{method}}"),
             (f"sum by (route) (rate(loraplex_http_requests_total{{{SEL}}}[{RATE}]))", "HTTP {{route}}"), span=12))
         .with_panel(timeseries(
             "Requests / s per adapter (top 10)",
             'Per-adapter traffic; the service exports its top-K adapters, the rest as adapter="other".',
             "reqps",
             (f"topk(10, sum by (adapter) (rate(loraplex_adapter_requests_total{{{SEL}}}[{RATE}])))",
              "{{adapter}}"), span=12))
         .with_panel(timeseries(
             "Health", "Pods whose grpc.health.v1 readiness / liveness reports SERVING (readiness drops "
             "while required preloads load, while draining and with a dead or stuck scheduler).", "none",
             (f"sum by (probe) (loraplex_health_serving{{{SEL}}})", "{{probe}}"),
             (f"sum(increase(loraplex_drain_cancelled_requests_total{{{SEL}}}[{RATE}]))",
              "cut at the end of a drain")))
         .with_panel(timeseries(
             "Preload entries", "Preload-file adapters by state; FAILED ones are retried with backoff. "
             "Failed attempts and applied preload-file changes per second.", "none",
             (f"sum by (state) (loraplex_preload_adapters{{{SEL}}})", "{{state}}"),
             (f"sum(rate(loraplex_preload_failures_total{{{SEL}}}[{RATE}]))", "failed attempts / s"),
             (f"sum(rate(loraplex_preload_reloads_total{{{SEL}}}[{RATE}]))", "file changes / s")))
         .with_panel(
             gtable.Panel().title("Router view (vllm:lora_requests_info)")
             .description("What an inference gateway sees for LoRA-affinity routing, per pod.")
             .datasource(DS).height(6).span(24).show_header(True)
             .targets([q("max by (pod, max_lora, running_lora_adapters, waiting_lora_adapters) "
                         f"(vllm:lora_requests_info{{{SEL}}})", instant=True)])))
    return d


def adapter_cache() -> gdash.Dashboard:
    d = base("loraplex-adapter-cache", "loraplex / adapter cache",
             "Adapter-cache sidecar: staged bytes, hit ratio, fetches from the object store, errors.",
             "loraplex_cache_capacity_bytes")
    hits = f"sum(rate(loraplex_cache_hits_total{{{SEL}}}[{RATE}]))"
    misses = f"sum(rate(loraplex_cache_misses_total{{{SEL}}}[{RATE}]))"
    d = (d.with_row(gdash.Row("Overview"))
         .with_panel(stat("Sidecars up", "Adapter-cache targets answering scrapes.", "none",
                          f'sum(up{{job="loraplex-cache", {SEL}}})'))
         .with_panel(stat("Cache fill", "Staged bytes / capacity, all pods.", "percentunit",
                          f"sum(loraplex_cache_bytes{{{SEL}}}) / sum(loraplex_cache_capacity_bytes{{{SEL}}})"))
         .with_panel(stat("Hit ratio", "Stage requests served from the host cache.", "percentunit",
                          f"{hits} / clamp_min({hits} + {misses}, 1e-9)"))
         .with_panel(stat("Entries", "Staged adapters, all pods.", "none",
                          f"sum(loraplex_cache_entries{{{SEL}}})"))
         .with_panel(stat("Leases", "Staged adapters leased by the inference service.", "none",
                          f"sum(loraplex_cache_leases{{{SEL}}})"))
         .with_panel(stat("In-flight fetches", "Object-store fetches in progress.", "none",
                          f"sum(loraplex_cache_inflight_fetches{{{SEL}}})")))
    d = (d.with_row(gdash.Row("Cache"))
         .with_panel(timeseries(
             "Cache bytes", "Staged bytes against the byte budget, per pod.", "bytes",
             (f"sum by (pod) (loraplex_cache_bytes{{{SEL}}})", "{{pod}} staged"),
             (f"sum by (pod) (loraplex_cache_capacity_bytes{{{SEL}}})", "{{pod}} capacity")))
         .with_panel(timeseries(
             "Hit ratio", "Hits / (hits + misses).", "percentunit",
             (f"{hits} / clamp_min({hits} + {misses}, 1e-9)", "hit ratio")))
         .with_panel(timeseries(
             "Hits, misses, evictions / s", "Stage requests by outcome, and LRU evictions.", "ops",
             (hits, "hits"), (misses, "misses"),
             (f"sum(rate(loraplex_cache_evictions_total{{{SEL}}}[{RATE}]))", "evictions")))
         .with_panel(timeseries(
             "Entries and leases", "Staged adapters and how many are leased.", "none",
             (f"sum(loraplex_cache_entries{{{SEL}}})", "entries"),
             (f"sum(loraplex_cache_leases{{{SEL}}})", "leases"))))
    d = (d.with_row(gdash.Row("Object store"))
         .with_panel(timeseries(
             "Stage latency", "Time to stage an adapter (hit or fetch).", "s",
             *quantiles("loraplex_cache_stage_seconds")))
         .with_panel(timeseries(
             "Fetched bytes / s", "Bytes read from the object store.", "Bps",
             (f"sum by (pod) (rate(loraplex_cache_fetched_bytes_total{{{SEL}}}[{RATE}]))", "{{pod}}")))
         .with_panel(timeseries(
             "Fetch requests / s and in flight", "Object-store GETs per second and fetches in progress.",
             "short",
             (f"sum(rate(loraplex_cache_fetch_requests_total{{{SEL}}}[{RATE}]))", "requests/s"),
             (f"sum(loraplex_cache_inflight_fetches{{{SEL}}})", "in flight")))
         .with_panel(timeseries(
             "Errors / s by reason", "Stage failures by reason (store, digest, validation, capacity...).",
             "ops",
             (f"sum by (reason) (rate(loraplex_cache_errors_total{{{SEL}}}[{RATE}]))", "{{reason}}"),
             span=24)))
    return d


DASHBOARDS = {"loraplex-serving.json": serving, "loraplex-adapter-cache.json": adapter_cache}


def render(name: str) -> str:
    """The committed text of one dashboard file (panel ids numbered here: the builder leaves them unset)."""
    board = DASHBOARDS[name]().build()
    for panel_id, panel in enumerate(board.panels or [], start=1):
        panel.id_val = panel_id
    return json.dumps(board, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main() -> int:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name in DASHBOARDS:
        (OUT_DIR / name).write_text(render(name))
        print(f"wrote {OUT_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
