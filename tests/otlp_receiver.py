"""OTLP trace receivers in the test process, as a collector receives spans: OTLP/HTTP (a POST of
an ``ExportTraceServiceRequest`` protobuf to ``/v1/traces``) and OTLP/gRPC (``TraceService.Export``
served by grpcio). Each keeps every request's raw bytes and decoded spans.

``python -m tests.otlp_receiver HTTP_PORT GRPC_PORT`` runs both until stopped, counting spans only
(the tracing benchmark's collector); a GET on the HTTP port answers ``{"spans": N}``.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass
class Received:
    """What a receiver got: the raw export requests and their spans, with their resources'
    service names."""

    keep: bool = True  # else count the spans only
    count: int = 0
    raw: list[bytes] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    services: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, body: bytes) -> None:
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        with self.lock:
            self.count += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            if not self.keep:
                return
            self.raw.append(body)
            for rs in req.resource_spans:
                self.services.update(
                    a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
                )
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)


class _Handler(BaseHTTPRequestHandler):
    received: Received

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces":
            self.send_response(404)
            self.end_headers()
            return
        self.received.add(body)
        answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def do_GET(self) -> None:
        answer = json.dumps({"spans": self.received.count}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:  # quiet
        pass


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: Any, context: Any) -> Any:
        self.received.add(request.SerializeToString())
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def http_receiver(port: int = 0, received: Received | None = None) -> Iterator[tuple[str, Received]]:
    """A running OTLP/HTTP receiver: its base URL (spans at ``/v1/traces``) and what it got."""
    received = received or Received()
    handler = type("Handler", (_Handler,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def grpc_receiver(port: int = 0, received: Received | None = None) -> Iterator[tuple[str, Received]]:
    """A running OTLP/gRPC receiver: its endpoint URL and what it got."""
    received = received or Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(received), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(grace=None)


def main(http_port: int, grpc_port: int) -> None:
    received = Received(keep=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with http_receiver(http_port, received), grpc_receiver(grpc_port, received):
        print(f"OTLP receiver: HTTP on {http_port}, gRPC on {grpc_port}", flush=True)
        while not stop.wait(10):
            print(f"spans received: {received.count}", flush=True)
    print(f"spans received: {received.count}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
