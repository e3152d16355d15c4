"""A slimserve app behind Serve's gRPC proxy (and HTTP proxy) on free loopback ports.

tests/grpc has no __init__.py on purpose: Ray workers get tests/ on PYTHONPATH, and a
package named `grpc` there would shadow the real grpc package.
"""

from __future__ import annotations

import contextlib
import time

import grpc
from loopback import free_port
from serve_stop import stop_serve

from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2_grpc

SERVICER = "app.serve.grpc_api.grpc_servicer.add_slimserve_grpc_servicers"


@contextlib.contextmanager
def grpc_app(ray_session, args: dict, name: str, metadata):
    """Serve restarted with a gRPC proxy, `build_app(args)` on it; all shut down after.

    Serve's proxy options are fixed when it starts, so a Serve started earlier in the
    session (without gRPC) is shut down first, and this one is shut down at the end.
    """
    from ray import serve
    from ray.serve.config import gRPCOptions

    from app.kvstore.handoff import box_name
    from app.kvstore.store import STORE_NAMESPACE, KVStoreClient
    from app.serve.build import build_app
    from app.serve.config import ServeArgs

    http_port, grpc_port = free_port(), free_port()
    stop_serve()
    serve.start(
        http_options={"host": "127.0.0.1", "port": http_port},
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER]),
    )
    serve.run(build_app(args), name=name, route_prefix="/")
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    try:
        _wait_for_grpc(channel, metadata)
        yield channel, f"http://127.0.0.1:{http_port}"
    finally:
        channel.close()
        stop_serve()  # deletes the app too, without waiting on a replica still starting
        cfg = ServeArgs(**args)
        if cfg.mode == "disaggregated":
            with contextlib.suppress(Exception):
                for shard in KVStoreClient.from_name(cfg.store_name, cfg.store_shards).shards:
                    ray_session.kill(shard)
                box = box_name(cfg.store_name)
                ray_session.kill(ray_session.get_actor(box, namespace=STORE_NAMESPACE))


def _wait_for_grpc(channel, metadata, deadline_s: float = 120) -> None:
    stub = generation_pb2_grpc.GenerationStub(channel)
    end = time.monotonic() + deadline_s
    while True:
        try:
            stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=10)
            return
        except grpc.RpcError:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


def wait_until_idle(handle, timeout_s: float = 30) -> dict:
    """The replica has no request left and every KV block is free (cached ones count)."""
    end = time.monotonic() + timeout_s
    while True:
        s = handle.stats.remote().result(timeout_s=30)
        idle = s["num_running"] == 0 and s["num_waiting"] == 0
        if idle and s["kv_blocks_free"] == s["kv_blocks_total"]:
            return s
        assert time.monotonic() < end, f"blocks still held: {s}"
        time.sleep(0.2)
