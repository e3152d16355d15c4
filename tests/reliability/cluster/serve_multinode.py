"""The disaggregated Serve app spread over a local multi-node cluster, and the node of its
decode replica removed while streams are in flight (run in its own process, like
multinode.py: it needs its own Ray).

Layout: a head node with no CPUs (Serve's controller and its one HTTP + gRPC proxy, head
only: every node of this cluster shares the machine's ports) and three 1-CPU nodes; each
engine replica asks for one CPU, so prefill and decode land on two different nodes and the
third is free for a replacement. The ingress is pinned to the head node (left to Serve,
it shared the decode replica's node in both runs, and that node's loss was the ingress's
too: docs/reliability.md); the store shard lands where Ray puts it (reported). STREAMS
streams (half HTTP, half gRPC) run when the decode replica's node is removed; each must end
with the undisturbed text or a clean retriable error. Serve must then replace the replica on
another node and serve correctly.

    python -m reliability.cluster.serve_multinode MODEL_PATH OUT.json
"""

from __future__ import annotations

import sys
import threading

from ray import serve
from ray.cluster_utils import Cluster
from ray.serve.config import gRPCOptions
from ray.util.state import list_actors

from app.serve import build
from app.serve.config import ServeArgs
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2_grpc
from reliability.cluster.runner import run_scenario
from reliability.serve.apps import offline_texts, prompts, wait_until
from reliability.serve.clients import grpc_stream, http_stream, run_all, tally, wait_idle

APP, STORE = "rel-multinode-serve", "rel-multinode-serve-kv"
STREAMS, TOKENS = 16, 160
SERVICER = "app.serve.grpc_api.grpc_servicer.add_slimserve_grpc_servicers"
MD = (("application", APP),)


def node_of(name_part: str) -> dict[str, str]:
    """Alive actors whose name contains `name_part` -> {name: node id}."""
    alive = list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=10000)
    return {a.name: a.node_id for a in alive if a.name and name_part in a.name}


def pinned_app(cfg: ServeArgs) -> serve.Application:
    """build_app's disaggregated graph, the same deployments, but the ingress asks for the
    head node's `ingress` resource, so that a replica's node never holds it."""
    build.ensure_store(cfg)
    plain = cfg.model_dump()
    ingress = build.Ingress.options(
        ray_actor_options={"num_cpus": 0, "resources": {"ingress": 1}},
        max_ongoing_requests=cfg.max_ongoing_requests * 4,
    )
    prefill = build._engine_deployment(
        build.PrefillServer, cfg, cfg.num_prefill_replicas, "prefill"
    )
    decode = build._engine_deployment(build.DecodeServer, cfg, cfg.num_decode_replicas, "decode")
    return ingress.bind(plain, prefill=prefill.bind(plain), decode=decode.bind(plain))


def start(model: str):
    from loopback import free_port
    from serve.apps import tiny_serve_args

    http_port, grpc_port = free_port(), free_port()
    serve.start(
        proxy_location="HeadOnly",
        http_options={"host": "127.0.0.1", "port": http_port},
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER]),
    )
    cfg = tiny_serve_args(model, engine={"dtype": "float32"}, store_name=STORE, replica_num_cpus=1)
    serve.run(pinned_app(ServeArgs(**cfg)), name=APP, route_prefix="/")
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    return f"http://127.0.0.1:{http_port}", generation_pb2_grpc.GenerationStub(channel)


def calls(url, stub, batch):
    return [
        (lambda p=p: http_stream(url, p, TOKENS))
        if i % 2 == 0
        else (lambda p=p: grpc_stream(stub, p, TOKENS, MD))
        for i, p in enumerate(batch)
    ]


def scenario(model: str, cluster: Cluster) -> dict:
    nodes = [cluster.add_node(num_cpus=1, object_store_memory=80 << 20) for _ in range(3)]
    cluster.wait_for_nodes()
    batch = prompts(STREAMS, seed=7)
    wants = offline_texts(model, batch, TOKENS)
    url, stub = start(model)
    wait_until(lambda: http_stream(url, batch[0], 4).error is None, 180, "app answering")
    before = {k: node_of(k) for k in ("#Ingress#", "#PrefillServer#", "#DecodeServer#", STORE)}
    victim_of = "DecodeServer"
    (victim_id,) = before[f"#{victim_of}#"].values()
    decode = serve.get_deployment_handle("DecodeServer", APP)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(out=run_all(calls(url, stub, batch))))
    runner.start()

    def decoding():
        s = decode.stats.remote().result(timeout_s=30)
        return s["num_running"] + s["num_waiting"] >= STREAMS // 2

    wait_until(decoding, 120, "streams decoding")
    cluster.remove_node(next(n for n in nodes if n.node_id == victim_id))
    runner.join(300)
    assert not runner.is_alive(), "a stream hung after the node was removed"
    during = tally(result["out"], wants)
    wait_until(lambda: http_stream(url, batch[0], 4).error is None, 300, "first success")
    after = run_all(calls(url, stub, batch[:8]))
    idle = {
        d: wait_idle(serve.get_deployment_handle(d, APP), 60)["kv_blocks_free"]
        for d in ("PrefillServer", "DecodeServer")
    }
    return {
        "nodes": 4,
        "streams": STREAMS,
        "placement_before": {k: sorted(v.values()) for k, v in before.items()},
        "removed_replica": victim_of,
        "removed_node": victim_id,
        "removed_also": [k for k, v in before.items() if victim_id in v.values()],
        "during": dict(during),
        "errors": sorted({o.error[:80] for o in result["out"] if o.error}),
        "after": dict(tally(after, wants[:8])),
        "replica_after": sorted(node_of(f"#{victim_of}#").values()),
        "idle_blocks_free": idle,
    }


def main(model: str, out_path: str) -> None:
    head = {"num_cpus": 0, "resources": {"ingress": 1}}  # only the ingress fits on the head
    run_scenario(scenario, model, out_path, head, before_shutdown=serve.shutdown)


if __name__ == "__main__":
    main(*sys.argv[1:3])
