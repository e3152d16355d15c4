"""This process's token-aware routers, by deployment name, for the direct call channel
(app/serve/direct_calls.py), which reads their replica lists and routing stats.

A module of its own because Serve ships the router class to each handle's process pickled
*by value* with its module's globals (`RequestRouterConfig`): a registry kept in
app/serve/router.py would be a private copy per unpickling. This module is pickled by
reference, so every router and every reader share the one below.
"""

from __future__ import annotations

from typing import Any

_ROUTERS: dict[str, Any] = {}  # deployment name -> TokenAwareRouter


def register(deployment: str, router: Any) -> None:
    _ROUTERS[deployment] = router


def router_for(deployment: str) -> Any | None:
    """The router of this process's handles to ``deployment`` (made on the handle's first
    call; it runs on Serve's router thread, so readers only read: the replica dict is
    replaced, never changed in place)."""
    return _ROUTERS.get(deployment)
