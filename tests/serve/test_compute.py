"""Whether a prefill replica shares its decode replica's compute (no Ray: reports given)."""

from app.serve.routing.compute import Compute, shares_compute

CPU2 = Compute("node-a", (), (0, 1), threads=2)  # `torch_threads: auto` on a 2-core box


def test_cpu_replicas_whose_threads_exceed_their_common_cores_share():
    assert shares_compute(CPU2, CPU2)
    one = Compute("node-a", (), (0, 1), threads=1)
    assert shares_compute(CPU2, one)  # 3 threads on 2 cores
    assert not shares_compute(one, one)  # a core each


def test_disjoint_cores_or_nodes_do_not_share():
    assert not shares_compute(CPU2, Compute("node-a", (), (2, 3), threads=2))
    assert not shares_compute(CPU2, Compute("node-b", (), (0, 1), threads=2))


def test_gpu_replicas_share_only_a_common_gpu():
    gpu0 = Compute("node-a", ("0",), (0, 1), threads=2)
    assert shares_compute(gpu0, Compute("node-a", ("0",), (0, 1), threads=2))
    assert not shares_compute(gpu0, Compute("node-a", ("1",), (0, 1), threads=2))
    assert not shares_compute(gpu0, CPU2)  # the CPU replica's threads are not the GPU's


def test_unknown_compute_is_never_shared():
    assert not shares_compute(None, CPU2) and not shares_compute(CPU2, None)


def test_a_report_round_trips():
    gpu = Compute("node-a", ("GPU-1", "GPU-2"), (0, 3), threads=4)
    assert Compute.from_report(gpu.report()) == gpu
    assert Compute.from_report(None) is None
