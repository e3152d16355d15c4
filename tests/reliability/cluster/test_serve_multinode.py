"""The disaggregated Serve app over a multi-node local cluster with the decode replica's
node removed mid-run (reliability.cluster.serve_multinode, in a subprocess: it starts its
own Ray; the ingress is pinned to the head node). Every stream ends with the undisturbed
text or a clean retriable error, Serve replaces the replica on a node that is still there,
the next requests are correct and every block is free.

Seen failing: the first version left the ingress's placement to Serve, which put it on the
decode replica's node: all 16 streams were wrong by this test's rule (8 gRPC INTERNAL "The
actor died unexpectedly", 8 HTTP streams cut without a finish reason): the ingress's own
loss, an open finding in docs/reliability.md, not a replica's."""

import pytest

from reliability.cluster.runner import run_script

pytestmark = [pytest.mark.long, pytest.mark.ray]


def test_decode_replica_node_removed_mid_run(long_model, tmp_path):
    out = tmp_path / "serve_multinode.json"
    got = run_script("reliability.cluster.serve_multinode", long_model, out)
    print(f"serve multinode: {got}")  # docs/reliability.md quotes these
    during = got["during"]
    assert during.get("wrong", 0) == 0 and sum(during.values()) == got["streams"], got
    # the decode replica's node, never the ingress's (pinned to the head); a store shard may
    # share it (Ray places those): its loss is then part of the run
    assert "#DecodeServer#" in got["removed_also"], got
    assert "#Ingress#" not in got["removed_also"], got
    assert got["removed_node"] not in got["replica_after"], got
    assert got["after"] == {"correct": 8}, got
