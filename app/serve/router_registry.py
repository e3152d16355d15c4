"""This process's token-aware routers, by deployment name, for the direct call channel
(app/serve/direct_calls.py), which reads their replica lists and routing stats.

A module of its own because Serve ships the router class to each handle's process pickled
*by value* with its module's globals (`RequestRouterConfig`): a registry kept in
app/serve/router.py would be a private copy per unpickling. This module is pickled by
reference, so every router and every reader share the one below.
"""

from __future__ import annotations

from typing import Any

_ROUTERS: dict[tuple[str, str], Any] = {}  # (app, deployment) -> TokenAwareRouter


def register(app: str, deployment: str, router: Any) -> None:
    _ROUTERS[(app, deployment)] = router


def router_for(app: str, deployment: str) -> Any | None:
    """The router of this process's handles to ``deployment`` of ``app`` (made on the
    handle's first call). It runs on Serve's router thread: readers only read, and copy
    its replica dict's values before iterating them (Ray replaces the dict on updates and
    pops dead replicas from it)."""
    return _ROUTERS.get((app, deployment))
