#!/usr/bin/env python3
"""Writes deploy/grafana/dashboards/*.json (Grafana's dashboard JSON model, schemaVersion 39).

The dashboards are committed as JSON; this script is how they are edited: change a panel here,
run `python3 deploy/grafana/generate.py`, commit both. Every panel's expression is run against
a real Prometheus by tests/tests/e2e/observability.rs.
"""
import json
import os

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'namespace=~"$namespace"'
SEL_EM = 'namespace=~"$namespace", engine=~"$engine", model=~"$model"'
SEL_VLLM = 'namespace=~"$namespace", model_name=~"$model"'
RI = "$__rate_interval"


def templating(engine_model=True):
    v = [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1},
        {"name": "namespace", "label": "Namespace", "type": "query", "datasource": DS,
         "query": {"query": "label_values(up, namespace)", "refId": "namespace"},
         "definition": "label_values(up, namespace)",
         "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
         "refresh": 2, "sort": 1},
    ]
    if engine_model:
        v += [
            {"name": "engine", "label": "Engine", "type": "query", "datasource": DS,
             "query": {"query": "label_values(tokentap_inflight_calls, engine)", "refId": "engine"},
             "definition": "label_values(tokentap_inflight_calls, engine)",
             "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
             "refresh": 2, "sort": 1},
            {"name": "model", "label": "Model", "type": "query", "datasource": DS,
             "query": {"query": 'label_values(tokentap_inflight_calls{engine=~"$engine"}, model)', "refId": "model"},
             "definition": 'label_values(tokentap_inflight_calls{engine=~"$engine"}, model)',
             "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
             "refresh": 2, "sort": 1},
        ]
    return {"list": v}


class Board:
    def __init__(self, uid, title, description, engine_model=True):
        self.uid, self.title, self.description = uid, title, description
        self.engine_model = engine_model
        self.panels = []
        self.y = 0
        self.x = 0

    def row(self, title):
        self.newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "id": len(self.panels) + 1,
                            "panels": []})
        self.y += 1

    def newline(self):
        if self.x:
            self.x = 0
            self.y += 8

    def panel(self, title, description, targets, unit="short", kind="timeseries", w=12, stack=False,
              minv=None, maxv=None):
        if self.x + w > 24:
            self.newline()
        field = {"unit": unit}
        if minv is not None:
            field["min"] = minv
        if maxv is not None:
            field["max"] = maxv
        if kind == "timeseries":
            field["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if stack else 0,
                               "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
        p = {
            "id": len(self.panels) + 1,
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"h": 8, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": field, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else
                       {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "textMode": "auto"},
            "targets": [
                {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
                 "range": True, "instant": False}
                for i, (expr, legend) in enumerate(targets)
            ],
        }
        self.panels.append(p)
        self.x += w
        if self.x >= 24:
            self.newline()

    def json(self):
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["tokentap"],
            "editable": True,
            "graphTooltip": 1,
            "schemaVersion": 39,
            "version": 1,
            "refresh": "30s",
            "time": {"from": "now-3h", "to": "now"},
            "timepicker": {},
            "timezone": "",
            "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                      "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                      "name": "Annotations & Alerts", "type": "dashboard"}]},
            "links": [{"title": "tokentap dashboards", "type": "dashboards", "tags": ["tokentap"], "asDropdown": True}],
            "templating": templating(self.engine_model),
            "panels": self.panels,
        }


def gpu_throughput():
    b = Board("tokentap-gpu-throughput", "tokentap / GPU throughput",
              "Generation throughput per engine, from tokentap's captures and from the engines' own metrics, beside GPU utilisation (DCGM).")
    b.row("Tokens per second")
    b.panel("Generated tokens/s (tokentap)", "Completion tokens of every captured call, per engine and model.",
            [(f'sum by (engine, model) (rate(tokentap_completion_tokens_total{{{SEL_EM}}}[{RI}]))', "{{engine}} {{model}}")],
            unit="short")
    b.panel("Generated tokens/s (the engines' own counters)", "vLLM vllm:generation_tokens_total, SGLang sglang:generation_tokens_total, llama.cpp llamacpp:tokens_predicted_total (recording rule engine:generation_tokens:rate1m; llama.cpp names no model).",
            [(f'sum by (engine, model, pod) (engine:generation_tokens:rate1m{{namespace=~"$namespace", engine=~"$engine"}})', "{{engine}} {{model}} {{pod}}")])
    b.panel("Prompt tokens/s (tokentap)", "Prompt tokens of every captured call, per engine and model.",
            [(f'sum by (engine, model) (rate(tokentap_prompt_tokens_total{{{SEL_EM}}}[{RI}]))', "{{engine}} {{model}}")])
    b.panel("Generated tokens/s by policy version", "Which weights the tokens came from (async RL: several versions can be in flight).",
            [(f'sum by (policy_version) (rate(tokentap_completion_tokens_total{{{SEL_EM}}}[{RI}]))', "{{policy_version}}")])
    b.row("GPUs (DCGM)")
    b.panel("GPU utilisation", "DCGM_FI_DEV_GPU_UTIL per GPU, labelled with the pod using it.",
            [(f'avg by (Hostname, gpu, pod) (DCGM_FI_DEV_GPU_UTIL{{{SEL}}})', "{{Hostname}} gpu{{gpu}} {{pod}}")],
            unit="percent", minv=0, maxv=100)
    b.panel("Graphics engine active", "DCGM_FI_PROF_GR_ENGINE_ACTIVE (in dcgm-exporter's default counters): the share of time the GPU's engine has work. Closer to real compute use than GPU_UTIL. (SM_ACTIVE is finer but not a default counter: add it to the exporter's counters CSV to use it.)",
            [(f'avg by (Hostname, gpu, pod) (DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{SEL}}})', "{{Hostname}} gpu{{gpu}} {{pod}}")],
            unit="percentunit", minv=0, maxv=1)
    b.panel("Tokens/s per busy GPU", "Each engine pod's generation tokens/s (its own counters) divided by its GPUs' utilisation, joined on namespace and pod: throughput per unit of GPU time.",
            [(f'sum by (namespace, pod, engine) (engine:generation_tokens:rate1m{{namespace=~"$namespace", engine=~"$engine", model=~"$model"}}) / on (namespace, pod) group_left sum by (namespace, pod) (DCGM_FI_DEV_GPU_UTIL{{{SEL}}} / 100)', "{{engine}} {{pod}}")])
    b.row("Engine queues and caches")
    b.panel("vLLM requests running / waiting", "vllm:num_requests_running and vllm:num_requests_waiting.",
            [(f'sum by (model_name) (vllm:num_requests_running{{{SEL_VLLM}}})', "running {{model_name}}"),
             (f'sum by (model_name) (vllm:num_requests_waiting{{{SEL_VLLM}}})', "waiting {{model_name}}")])
    b.panel("KV cache usage", "vLLM vllm:kv_cache_usage_perc (vllm:gpu_cache_usage_perc before v0.10) and SGLang sglang:token_usage (1 = full).",
            [(f'max by (model_name) (vllm:kv_cache_usage_perc{{{SEL_VLLM}}} or vllm:gpu_cache_usage_perc{{{SEL_VLLM}}})', "vLLM {{model_name}}"),
             (f'max by (model_name) (sglang:token_usage{{{SEL_VLLM}}})', "SGLang {{model_name}}")],
            unit="percentunit", minv=0, maxv=1)
    b.panel("Prefix cache hit rate", "vLLM: hits / queries over the interval; SGLang: sglang:cache_hit_rate. Prefix merging keeps this high.",
            [(f'sum by (model_name) (rate(vllm:prefix_cache_hits_total{{{SEL_VLLM}}}[{RI}])) / sum by (model_name) (rate(vllm:prefix_cache_queries_total{{{SEL_VLLM}}}[{RI}]))', "vLLM {{model_name}}"),
             (f'max by (model_name) (sglang:cache_hit_rate{{{SEL_VLLM}}})', "SGLang {{model_name}}")],
            unit="percentunit", minv=0, maxv=1)
    b.panel("SGLang requests running / queued", "sglang:num_running_reqs and sglang:num_queue_reqs.",
            [(f'sum by (model_name) (sglang:num_running_reqs{{{SEL_VLLM}}})', "running {{model_name}}"),
             (f'sum by (model_name) (sglang:num_queue_reqs{{{SEL_VLLM}}})', "queued {{model_name}}")])
    b.panel("llama.cpp requests processing / deferred", "llamacpp:requests_processing and llamacpp:requests_deferred (llama-server --metrics).",
            [(f'sum by (instance) (llamacpp:requests_processing{{{SEL}}})', "processing {{instance}}"),
             (f'sum by (instance) (llamacpp:requests_deferred{{{SEL}}})', "deferred {{instance}}")])
    return b


def where_time_goes():
    b = Board("tokentap-where-time-goes", "tokentap / Where the time goes",
              "Per harness: the engine answering, the proxy, and the harness and its tools between a session's calls.")
    b.row("Sessions' time")
    b.panel("Session time by part", "Seconds per second spent in the engine, the proxy and the harness/tools, per harness (recording rule tokentap:session_seconds:rate5m).",
            [(f'sum by (harness, part) (tokentap:session_seconds:rate5m{{{SEL_EM}}})', "{{harness}} {{part}}")],
            unit="s", stack=True)
    b.panel("Harness time share", "harness / (harness + engine + proxy): the share of a session's time its engine sits idle while its harness works.",
            [(f'tokentap:harness_time_share:ratio_rate5m{{{SEL_EM}}}', "{{harness}} {{engine}} {{model}}")],
            unit="percentunit", minv=0, maxv=1)
    b.panel("Share of session time by part", "Each part's share of a harness's session time: engine (GPUs answering), proxy, harness/tools (the engine idle for this session).",
            [(f'sum by (harness, part) (tokentap:session_seconds:rate5m{{{SEL_EM}}}) / on (harness) group_left sum by (harness) (tokentap:session_seconds:rate5m{{{SEL_EM}}})', "{{harness}} {{part}}")],
            unit="percentunit", minv=0, maxv=1, stack=True)
    b.panel("Engine time per harness", "tokentap_engine_seconds_total per second, per harness.",
            [(f'sum by (harness) (rate(tokentap_engine_seconds_total{{{SEL_EM}}}[{RI}]))', "{{harness}}")], unit="s")
    b.panel("Harness/tool time per harness", "tokentap_harness_seconds_total per second, per harness.",
            [(f'sum by (harness) (rate(tokentap_harness_seconds_total{{{SEL_EM}}}[{RI}]))', "{{harness}}")], unit="s")
    b.row("Load")
    b.panel("Sessions active", "Sessions with a call in flight or one that ended in the last 5 minutes.",
            [(f'sum by (harness) (tokentap_sessions_active{{{SEL_EM}}})', "{{harness}}")])
    b.panel("Calls in flight / held by the gate", "tokentap_inflight_calls, and calls the rollout node's admission gate holds (a weight update).",
            [(f'sum by (engine, model) (tokentap_inflight_calls{{{SEL_EM}}})', "in flight {{engine}} {{model}}"),
             (f'sum by (engine, model) (tokentap_gate_waiting_calls{{{SEL_EM}}})', "held {{engine}} {{model}}")])
    b.panel("Time to first token", "p50 and p95 of tokentap_time_to_first_token_seconds.",
            [(f'histogram_quantile(0.5, sum by (le, engine) (rate(tokentap_time_to_first_token_seconds_bucket{{{SEL_EM}}}[{RI}])))', "p50 {{engine}}"),
             (f'histogram_quantile(0.95, sum by (le, engine) (rate(tokentap_time_to_first_token_seconds_bucket{{{SEL_EM}}}[{RI}])))', "p95 {{engine}}")],
            unit="s")
    b.panel("Proxy overhead", "p50 and p99 of the time a call spends in the proxy, not the engine.",
            [(f'histogram_quantile(0.5, sum by (le) (rate(tokentap_proxy_overhead_seconds_bucket{{{SEL}}}[{RI}])))', "p50"),
             (f'histogram_quantile(0.99, sum by (le) (rate(tokentap_proxy_overhead_seconds_bucket{{{SEL}}}[{RI}])))', "p99")],
            unit="s")
    b.panel("Gate hold time", "p99 of how long the admission gate held a call before the engine.",
            [(f'histogram_quantile(0.99, sum by (le, engine) (rate(tokentap_gate_hold_seconds_bucket{{{SEL_EM}}}[{RI}])))', "p99 {{engine}}")],
            unit="s")
    return b


def rollouts():
    b = Board("tokentap-rollouts", "tokentap / Rollouts",
              "Rollout nodes: samples in each stage, samples per hour, rewards; the workers' merge ratio and faithfulness.",
              engine_model=False)
    b.row("Samples")
    b.panel("Samples in stage", "tokentap_rollout_samples_in_stage: init, run, post_run.",
            [(f'sum by (stage) (tokentap_rollout_samples_in_stage{{{SEL}}})', "{{stage}}")], stack=True)
    b.panel("Samples waiting for a stage", "tokentap_rollout_queue_depth (run: prepared ahead, i.e. prewarmed).",
            [(f'sum by (stage) (tokentap_rollout_queue_depth{{{SEL}}})', "{{stage}}")])
    b.panel("Samples per hour", "Ended samples by outcome (recording rule tokentap:rollout_samples:per_hour).",
            [(f'sum by (outcome) (tokentap:rollout_samples:per_hour{{{SEL}}})', "{{outcome}}")])
    b.panel("Time in stage (p50)", "tokentap_rollout_stage_seconds, median per stage.",
            [(f'histogram_quantile(0.5, sum by (le, stage) (rate(tokentap_rollout_stage_seconds_bucket{{{SEL}}}[{RI}])))', "{{stage}}")],
            unit="s")
    b.row("Rewards")
    b.panel("Mean reward by task (1 h)", "Recording rule tokentap:rollout_reward:mean_rate1h (the first 200 task ids, then other).",
            [(f'tokentap:rollout_reward:mean_rate1h{{{SEL}}}', "{{task}}")])
    b.panel("Rewarded samples by task", "Completed and timed-out samples observed in tokentap_rollout_reward, per task.",
            [(f'sum by (task) (tokentap_rollout_reward_count{{{SEL}}})', "{{task}}")])
    b.row("Reconstruction")
    b.panel("Merge ratio", "tokentap_worker_merge_ratio: request-level traces per emitted trace (prefix merging at work).",
            [(f'max by (instance) (tokentap_worker_merge_ratio{{{SEL}}})', "{{instance}}")])
    b.panel("Traces written / faithfulness violations", "Traces per second, and violations over the dashboard's range (must stay 0).",
            [(f'sum by (instance) (rate(tokentap_worker_traces_emitted_total{{{SEL}}}[{RI}]))', "traces/s {{instance}}"),
             (f'sum by (instance) (increase(tokentap_worker_faithfulness_violations_total{{{SEL}}}[$__range]))', "violations {{instance}}")])
    return b


def capture_health():
    b = Board("tokentap-capture-health", "tokentap / Capture health",
              "Records written and lost, the spool, shipping to workers, and errors by kind.")
    b.row("Records and spool")
    b.panel("Records written / lost per second", "tokentap_records_written_total and tokentap_records_lost_total.",
            [(f'sum by (instance) (rate(tokentap_records_written_total{{{SEL}}}[{RI}]))', "written {{instance}}"),
             (f'sum by (instance) (rate(tokentap_records_lost_total{{{SEL}}}[{RI}]))', "lost {{instance}}")])
    b.panel("Spool size", "Bytes in each spool's segment files.",
            [(f'sum by (instance) (tokentap_spool_bytes{{{SEL}}})', "{{instance}}")], unit="bytes")
    b.panel("Spool writable", "1 while the spool takes records; 0 while appends fail (calls are refused under fail-closed).",
            [(f'min by (instance) (tokentap_spool_writable{{{SEL}}})', "{{instance}}")], kind="stat", w=6)
    b.panel("Spool write errors", "Failed appends and fsyncs per second (each retry counts).",
            [(f'sum by (instance) (rate(tokentap_spool_write_errors_total{{{SEL}}}[{RI}]))', "{{instance}}")], w=6)
    b.panel("Errors by kind", "Calls that ended in an error, per kind (engine unavailable, timeouts, bad requests, disconnects, …).",
            [(f'sum by (kind) (rate(tokentap_call_errors_total{{{SEL_EM}}}[{RI}]))', "{{kind}}")])
    b.row("Shipping to workers")
    b.panel("Shipping backlog", "Spool bytes written and not yet acked by the worker.",
            [(f'sum by (instance) (tokentap_ship_backlog_bytes{{{SEL}}})', "{{instance}}")], unit="bytes")
    b.panel("Time since the worker's last ack", "time() - tokentap_ship_last_ack_timestamp_seconds.",
            [(f'time() - max by (instance) (tokentap_ship_last_ack_timestamp_seconds{{{SEL}}} > 0)', "{{instance}}")], unit="s")
    b.panel("Records shipped / shipment errors / dead letters", "Acked records, failed shipments (retried), and records the worker will never take.",
            [(f'sum by (instance) (rate(tokentap_ship_records_total{{{SEL}}}[{RI}]))', "acked {{instance}}"),
             (f'sum by (instance) (rate(tokentap_ship_errors_total{{{SEL}}}[{RI}]))', "errors {{instance}}"),
             (f'sum by (instance) (rate(tokentap_ship_dead_letter_total{{{SEL}}}[{RI}]))', "dead letters {{instance}}")])
    b.panel("Worker ingest lag (p90) and backlog", "From a call's end to its record durable at the worker; records waiting to be reconstructed.",
            [(f'histogram_quantile(0.9, sum by (le, instance) (rate(tokentap_worker_ingest_lag_seconds_bucket{{{SEL}}}[{RI}])))', "lag p90 {{instance}}"),
             (f'sum by (instance) (tokentap_worker_reconstruct_backlog_records{{{SEL}}})', "backlog {{instance}}")])
    b.panel("Targets up", "Every scraped tokentap, engine and DCGM target.",
            [(f'up{{job=~"tokentap.*|engines|dcgm|kubernetes-pods", {SEL}}}', "{{job}} {{instance}}")], minv=0, maxv=1)
    return b


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dashboards")
    os.makedirs(out, exist_ok=True)
    for b in (gpu_throughput(), where_time_goes(), rollouts(), capture_health()):
        path = os.path.join(out, b.uid.replace("tokentap-", "") + ".json")
        with open(path, "w") as f:
            json.dump(b.json(), f, indent=2)
            f.write("\n")
        print(path)


if __name__ == "__main__":
    main()
