"""Stopping Serve so that the next `serve.start` gets a fresh controller."""

from __future__ import annotations

import time


def stop_serve(timeout_s: float = 120) -> None:
    """serve.shutdown(), then wait until the controller's name is released.

    `serve.shutdown` gives the controller 30 s to shut down gracefully and returns anyway;
    on a saturated machine the old controller then ends itself later, and a `serve.start`
    made in the meantime attaches to it and dies with it (seen in CI: the next module's
    `serve.run` failed with ActorDiedError, "killed by ray.kill")."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    serve.shutdown()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.2)
    raise TimeoutError(f"Serve's controller still registered {timeout_s} s after shutdown")
