"""Telemetry out: GET /v1/stats (the snapshot), /v1/stats/stream (SSE for the dashboard), /metrics.

All three serve the one snapshot schema of engine/runtime/telemetry.py. The stream sends a
snapshot every 0.2 s while a request runs (5/s) and every second when idle; while the model
loads it sends `event: health` with the /health body instead.
"""
from __future__ import annotations

import asyncio
import json
from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.server.generation import ready_engine
from engine.server.openai_api import SSE_HEADERS
from engine.server.worker import EngineWorker

BUSY_INTERVAL_S, IDLE_INTERVAL_S = 0.2, 1.0


async def stats(http: HttpRequest) -> Response:
    return JSONResponse(ready_engine(http.app.state.worker).telemetry.snapshot())


async def stats_stream(http: HttpRequest) -> Response:
    worker: EngineWorker = http.app.state.worker

    async def events():
        while True:
            if worker.status == "ok":
                yield f"data: {json.dumps(worker.engine.telemetry.snapshot())}\n\n"
            else:
                yield f"event: health\ndata: {json.dumps(worker.health())}\n\n"
            waited = 0.0
            while waited < IDLE_INTERVAL_S:  # wakes early when a request starts
                await asyncio.sleep(BUSY_INTERVAL_S)
                waited += BUSY_INTERVAL_S
                if worker.running:
                    break
    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


class SnapshotCollector:
    """Prometheus metrics computed from a fresh snapshot at each scrape."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        w = self.worker
        yield GaugeMetricFamily("moestudio_up", "1 when the model is loaded and serving", value=int(w.status == "ok"))
        yield GaugeMetricFamily("moestudio_load_progress_ratio", "model load progress 0..1", value=w.progress)
        yield GaugeMetricFamily("moestudio_queue_waiting", "requests waiting for the engine", value=w.waiting)
        yield GaugeMetricFamily("moestudio_queue_running", "requests generating now", value=w.running)
        if w.status != "ok":
            return
        s = w.engine.telemetry.snapshot()
        yield InfoMetricFamily("moestudio_engine", "engine and model", value={"engine": s["engine"], "model": s["model"]})
        for name, key, doc in (("requests", "requests", "finished requests"),
                               ("prompt_tokens", "prompt_tokens", "prompt tokens processed"),
                               ("completion_tokens", "completion_tokens", "tokens generated")):
            yield CounterMetricFamily(f"moestudio_{name}", doc, value=s[key])
        yield GaugeMetricFamily("moestudio_decode_tokens_per_second", "decode rate over recent steps",
                                value=s["decode_tokens_per_s_now"])
        last = s["last_request"]
        for key, name in (("ttft_s", "ttft_seconds"), ("prefill_tokens_per_s", "prefill_tokens_per_second"),
                          ("decode_tokens_per_s", "decode_tokens_per_second")):
            if key in last:
                yield GaugeMetricFamily(f"moestudio_last_{name}", f"{key} of the last finished request", value=last[key])
        yield GaugeMetricFamily("moestudio_ram_used_bytes", "resident memory of the engine process",
                                value=s["ram_used_bytes"])
        if s["gpu_memory_used_bytes"] is not None:
            yield GaugeMetricFamily("moestudio_gpu_memory_used_bytes", "GPU memory in use",
                                    value=s["gpu_memory_used_bytes"])
        cache = s["cache"]
        if cache is None:  # the llama.cpp engine has no expert cache: no series rather than zeros
            return
        yield GaugeMetricFamily("moestudio_expert_slots_per_layer", "expert cache slots per MoE layer",
                                value=cache["slots_per_layer"])
        yield GaugeMetricFamily("moestudio_gpu_miss_fraction", "share of expert misses uploaded to the GPU "
                                "(measured at load with --moe-gpu-miss-fraction auto)", value=cache["miss_fraction"])
        for key, doc in (("gpu_hit", "experts served from a resident slot"), ("uploaded", "experts uploaded on a miss"),
                         ("gpu_mapped", "misses the GPU read from pinned host memory"),
                         ("cpu_computed", "experts computed by the CPU pool"), ("swaps", "residency changes")):
            family = CounterMetricFamily(f"moestudio_expert_{key}", doc, labels=["layer"])
            for layer, value in zip(cache["layers"], cache[key]):
                family.add_metric([str(layer)], value)
            yield family
        yield CounterMetricFamily("moestudio_expert_upload_bytes", "bytes uploaded host to device",
                                  value=cache["bytes_uploaded"])
        yield CounterMetricFamily("moestudio_cpu_pool_busy_seconds", "CPU expert pool busy time",
                                  value=cache["cpu_busy_s"])
        steps = CounterMetricFamily("moestudio_prompt_layer_steps", "a prompt's MoE layer steps by route: missing "
                                    "experts streamed, all resident, or the routing read back", labels=["route"])
        for route, n in cache["prompt_steps"].items():
            steps.add_metric([route.replace(" ", "_")], n)
        yield steps
        yield CounterMetricFamily("moestudio_prompt_graph_chunks", "prompt chunks replayed as one CUDA graph "
                                  "(every expert resident)", value=cache["prompt_graph_chunks"])


def metrics_endpoint(worker: EngineWorker):
    registry = CollectorRegistry(auto_describe=False)  # per app: no clash with the global default registry
    registry.register(SnapshotCollector(worker))

    async def metrics(http: HttpRequest) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")
    return metrics
