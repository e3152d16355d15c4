"""Shared fixtures: tiny random Hugging Face checkpoints built with `transformers`."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402

from tiny_models import FAMILIES, make_checkpoint  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run compiled kernels on CUDA: skipped without a GPU, and under the
    Triton interpreter (on here by default; TRITON_INTERPRET=0 to run them)."""
    import torch

    reason = None
    if not torch.cuda.is_available():
        reason = "needs CUDA"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        reason = "TRITON_INTERPRET=1"
    for item in items if reason else ():
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_sessionstart(session):
    """The C++ CPU kernels are built (or loaded from torch's extension cache) once, here,
    before any test: on a machine without the cached builds the first build (about a minute
    each) then never lands inside a Serve replica's start or a timed-out request."""
    from slimserve_kernels import cpu_kernels

    cpu_kernels.build_all()


@pytest.fixture(scope="session", autouse=True)
def no_orphan_processes():
    """Set up first, torn down last: after every other fixture (Ray, TP workers) has ended,
    no process started by a test may still run (tests/reliability/orphans.py)."""
    yield
    from reliability.orphans import leftover_processes

    left = leftover_processes()
    assert not left, "processes outlived the test session:\n" + "\n".join(left)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """family name -> path of a tiny random checkpoint (built once per session)."""
    made = {}

    def get(family: str = "llama", **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(family)
            made[key] = make_checkpoint(family, str(out), **overrides)
        return made[key]

    return get


@pytest.fixture(scope="session")
def llama_path(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(params=sorted(FAMILIES))
def family_path(request, checkpoint_factory):
    return checkpoint_factory(request.param)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every test marked `ray` (and Serve on top of it); shut down at the end."""
    import ray

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    # Workers import actors defined in test modules (e.g. kvstore.test_store) by name.
    path = os.pathsep.join(
        [tests_dir, os.path.dirname(tests_dir), os.environ.get("PYTHONPATH", "")]
    )
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(
                address="local",  # a new cluster: never join another session's /tmp/ray one
                num_cpus=4,
                include_dashboard=False,
                object_store_memory=512 << 20,
                log_to_driver=False,
                runtime_env={"env_vars": {"TRITON_INTERPRET": "1", "PYTHONPATH": path}},
            )
        except BaseException:  # a start that timed out leaves GCS & co. running: stop them
            ray.shutdown()
            raise
    yield ray
    try:
        from serve_stop import stop_serve

        stop_serve()
    finally:
        if started:
            ray.shutdown()
