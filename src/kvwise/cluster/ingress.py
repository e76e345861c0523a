"""The cluster's front door: one OpenAI-compatible HTTP server in front of the engine replicas.

Each request is forwarded whole to a replica chosen by the deployment's router, and the
replica's response (status, headers, body, streamed as it comes) is passed back, so clients see
exactly the single server. Before routing, the ingress names the prompt's blocks
(`RoutingKeys`); that is all the router needs.

When a replica fails a request before anything was sent to the client (it died, or Ray lost
it), the request is sent again to another replica, up to `max_attempts`. A stream already under
way ends with an error event (`replica_lost`) the client can retry on. `/metrics` joins every
replica's metrics, each sample labelled with its `replica`, and adds the ingress's own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvwise.cluster.routed_request import RoutedRequest, RoutingKeys
from kvwise.server.app import read_body
from kvwise.server.protocol import OpenAIError

log = logging.getLogger("kvwise.cluster")
REPLICA_HEADER = "x-kvwise-replica"


@dataclass
class IngressCounters:
    requests: int = 0
    rerouted: int = 0  # sent again after a replica failed them before answering
    lost_streams: int = 0  # streams cut by a replica's failure (ended with an error event)
    overloaded: int = 0  # answered 503: every replica's queue was full


class Ingress:
    def __init__(self, handle, handlers, routing_keys: RoutingKeys, router_lookup, max_attempts: int = 3):
        self.handle, self.handlers, self.routing_keys = handle, handlers, routing_keys
        self.router_lookup = router_lookup  # () -> the deployment's router in this process, or None
        self.max_attempts = max_attempts
        self.counters = IngressCounters()

    async def forward(self, http: Request) -> Response:
        import ray.exceptions
        from ray.serve.exceptions import BackPressureError

        settings = self.handlers.settings
        body = await read_body(http, settings.max_body_bytes, settings.body_timeout_seconds)
        routed = RoutedRequest(http.method, http.url.path, http.scope.get("query_string", b""), http.headers.raw, body)
        routed = await asyncio.to_thread(self.routing_keys.annotate, routed)
        self.counters.requests += 1
        for attempt in range(self.max_attempts):
            stream = self.handle.options(stream=True).call.remote(routed)
            try:
                start = await stream.__anext__()
            except BackPressureError:
                self.counters.overloaded += 1
                error = OpenAIError(503, "every replica is at capacity; retry shortly", code="overloaded")
                error.headers = {"Retry-After": "1"}
                raise error from None
            except (ray.exceptions.RayError, StopAsyncIteration) as error:
                failed = self._sent_to(routed)
                if failed is not None and failed not in routed.avoid:
                    routed.avoid.append(failed)
                log.warning("replica %s failed a request before answering (%s); re-routing", failed, error)
                if attempt + 1 < self.max_attempts:
                    self.counters.rerouted += 1
                continue
            router = self.router_lookup()
            if router is not None:
                router.answering(start["replica"], routed.request_id)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]}
            headers.pop("content-length", None)
            headers[REPLICA_HEADER] = start["replica"]
            streaming = headers.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(
                self._relay(stream, streaming, start["replica"], routed.request_id),
                status_code=start["status"],
                headers=headers,
            )
        raise OpenAIError(503, "no replica could answer this request; retry shortly", code="replica_lost")

    async def _relay(self, stream, streaming: bool, replica: str, request_id: str):
        import ray.exceptions

        try:
            async for message in stream:
                yield message["body"]
        except ray.exceptions.RayError as error:
            self.counters.lost_streams += 1
            log.warning("a replica failed mid-response: %s", error)
            if streaming:
                message = "the replica serving this stream failed; retry the request"
                lost = OpenAIError(503, message, code="replica_lost")
                yield f"data: {json.dumps(lost.body())}\n\n".encode()
        finally:  # the client left, or the response ended: the replica stops generating for nobody
            stream.cancel()
            router = self.router_lookup()
            if router is not None:
                router.finished(replica, request_id)

    def _sent_to(self, routed: RoutedRequest) -> str | None:
        router = self.router_lookup()
        return None if router is None else router.sent_to.get(routed.request_id)

    async def metrics(self) -> str:
        """Every replica's metrics, labelled by replica, and the ingress's own."""
        router = self.router_lookup()
        replicas = router.replica_ids() if router is not None else []
        calls = [
            self.handle.metrics.remote(RoutedRequest("GET", "/metrics", b"", [], b"", target=replica))
            for replica in replicas
        ]
        texts = []
        for call in calls:
            try:
                texts.append(await asyncio.wait_for(call, timeout=5))
            except Exception as error:  # a replica that does not answer is left out of this scrape
                log.warning("a replica's metrics did not come: %s", error)
        return join_metrics(texts) + self._own_metrics(len(replicas))

    def _own_metrics(self, replicas: int) -> str:
        counters = self.counters
        lines = [
            "# HELP kvwise_cluster_replicas Engine replicas the router can send to",
            "# TYPE kvwise_cluster_replicas gauge",
            f"kvwise_cluster_replicas {replicas}",
        ]
        for name, value, help_text in (
            ("requests", counters.requests, "Requests the ingress forwarded"),
            ("rerouted", counters.rerouted, "Requests sent again after a replica failed them before answering"),
            ("lost_streams", counters.lost_streams, "Streams ended by a replica's failure"),
            ("overloaded", counters.overloaded, "Requests answered 503 because every replica was full"),
        ):
            lines += [
                f"# HELP kvwise_cluster_{name}_total {help_text}",
                f"# TYPE kvwise_cluster_{name}_total counter",
                f"kvwise_cluster_{name}_total {value}",
            ]
        return "\n".join(lines) + "\n"


def join_metrics(texts: list[tuple[str, str]]) -> str:
    """Prometheus texts of several replicas as one: each family once (its HELP and TYPE), with
    every replica's samples under it, labelled `replica`."""
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                header = families.setdefault(family, [])
                if line not in header:
                    header.append(line)
                samples.setdefault(family, [])
            elif line and not line.startswith("#") and family is not None:
                samples[family].append(_labelled(line, replica))
    out = []
    for family, header in families.items():
        out += header + samples[family]
    return "\n".join(out) + "\n" if out else ""


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?(\s.*)$")


def _labelled(sample: str, replica: str) -> str:
    match = _SAMPLE.match(sample)
    if match is None:
        return sample
    name, labels, value = match.groups()
    labels = f'replica="{replica}"' + (f",{labels}" if labels else "")
    return f"{name}{{{labels}}}{value}"


def create_ingress_app(ingress: Ingress) -> FastAPI:
    app = FastAPI(title="kvwise cluster")
    app.state.ingress = ingress

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.get("/health/live")
    async def live():
        return {"status": "live"}

    @app.get("/metrics")
    async def metrics(request: Request):
        ingress.handlers.check_metrics_access(request)
        return PlainTextResponse(await ingress.metrics(), media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def everything_else(request: Request, path: str):
        return await ingress.forward(request)

    return app
