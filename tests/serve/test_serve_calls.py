"""The private Ray Serve hook the request driver relies on is still there: a Ray upgrade that
renames or removes it fails here, not silently (admission would move to the first delta)."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from ray.serve.handle import DeploymentResponse, DeploymentResponseGenerator

from app.serve.channel.serve_calls import ASSIGNMENT_HOOK, assigned


def test_serve_responses_still_have_the_assignment_hook():
    for cls in (DeploymentResponse, DeploymentResponseGenerator):
        hook = getattr(cls, ASSIGNMENT_HOOK, None)
        assert hook is not None and inspect.iscoroutinefunction(hook), cls


def test_assigned_awaits_the_hook_and_raises_its_refusal():
    """Seen failing with `assigned` returning without awaiting the hook."""

    class Refused:
        cancelled = False

        async def _fetch_future_result_async(self):
            raise RuntimeError("queue full")

        def cancel(self):
            self.cancelled = True

    with pytest.raises(RuntimeError, match="queue full"):
        asyncio.run(assigned(Refused()))


def test_the_private_serve_api_slimserve_serve_uses_is_still_there():
    """`slimserve serve` (app/serve/cli.py) deploys through Serve's config path, as `serve
    deploy` does, via its client's `deploy_apps`, and checks the proxy switch Serve copied
    into its constants at import: both private, so a Ray upgrade that moves them fails here."""
    import ray.serve._private.constants as constants
    from ray.serve.context import _get_global_client

    assert callable(_get_global_client)
    from ray.serve._private.client import ServeControllerClient

    assert callable(getattr(ServeControllerClient, "deploy_apps", None))
    assert isinstance(constants.RAY_SERVE_ENABLE_HA_PROXY, bool)
