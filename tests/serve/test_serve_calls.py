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
