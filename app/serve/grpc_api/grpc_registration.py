"""Registration of slimserve's gRPC services on Ray Serve's gRPC proxy (runs in the proxy).

`grpc_options.grpc_servicer_functions` names
`app.serve.grpc_api.grpc_servicer.add_slimserve_grpc_servicers` (re-exported from here). The proxy
calls it with a placeholder servicer: every method registered is routed to the ingress
deployment's method of the same name (app/serve/grpc_api/grpc_servicer.py).
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError

from app.serve.grpc_api.grpc_convert import MalformedRequest
from app.serve.grpc_api.grpc_gen.grpc.health.v1 import health_pb2_grpc
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2_grpc


def add_slimserve_grpc_servicers(servicer: Any, server: grpc.Server) -> None:
    """What `grpc_options.grpc_servicer_functions` names:
    `app.serve.grpc_api.grpc_servicer.add_slimserve_grpc_servicers`.

    Serve's proxy calls it with a placeholder servicer and routes every method it registers
    to the ingress deployment: slimserve.v1.Generation and grpc.health.v1.Health. The proxy
    parses requests with the deserializers registered here; ours turn an unparsable message
    (e.g. a string field that is not UTF-8) into a `MalformedRequest` that the replica
    answers with INVALID_ARGUMENT, where grpcio's own would fail the call as INTERNAL.
    """
    lenient = _LenientServer(server)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, lenient)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, lenient)


class _LenientServer:
    """Forwards handler registration to the server with forgiving request deserializers."""

    def __init__(self, server: grpc.Server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        for handler in handlers:
            table = handler._method_handlers  # grpc's DictionaryGenericHandler (Serve reads it)
            handler._method_handlers = {k: _lenient(h) for k, h in table.items()}
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        lenient = {name: _lenient(h) for name, h in handlers.items()}
        self._server.add_registered_method_handlers(service, lenient)


def _lenient(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError as e:
            return MalformedRequest(str(e))

    return handler._replace(request_deserializer=deserialize)
