"""`slimserve serve` stopped while its app is still deploying, as a supervisor stops one
process (SIGTERM to the CLI) or as `timeout` stops a command (SIGTERM to its process group):
it exits with code 0 and nothing of its process tree, HAProxy included, outlives it
(`stop_while_starting` checks the tree; for a group, that the CLI saw its Ray gone and
skipped the shutdowns that would ask it: app/serve/reaper.py)."""

from __future__ import annotations

import pytest
from serve.apps import tiny_serve_args

from reliability.serve.cli_server import stop_while_starting

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.parametrize("group", [False, True], ids=["cli", "group"])
def test_a_server_stopped_while_it_deploys_exits_cleanly(llama_path, group):
    """Seen failing, both, with the CLI's SIGTERM handler installed once the app ran: Ray's
    own ended the CLI with nothing shut down (code 15; by hand, -6 with HAProxy left)."""
    args = tiny_serve_args(llama_path, mode="colocated", engine={"dtype": "float32"})
    stopped = stop_while_starting(args, "haproxy", group_stop=group)
    assert not any("OpenAI API on" in line for line in stopped.said), stopped.said  # deploying
    assert stopped.returncode == 0, stopped.said
