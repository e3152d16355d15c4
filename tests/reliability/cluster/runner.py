"""What the multi-node scenarios share: each runs as a script in its own process (it starts
its own Ray on a `ray.cluster_utils.Cluster`) and writes its result as JSON for the test.

- `run_scenario` is the script side: start the cluster's head, run the scenario, tear
  everything down (also on failure), write the JSON.
- `run_script` is the test side: run such a script as `python -m MODULE MODEL OUT` with
  tests/ and the repository on the path, and read the JSON back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_scenario(
    scenario: Callable[[str, Cluster], dict],
    model: str,
    out_path: str,
    head_node_args: dict,
    before_shutdown: Callable[[], None] = lambda: None,
) -> None:
    cluster = Cluster(initialize_head=True, head_node_args=head_node_args)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        result = scenario(model, cluster)
    finally:
        try:
            before_shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def run_script(module: str, model: str, out: Path) -> dict:
    path = os.pathsep.join([TESTS, os.path.dirname(TESTS), os.environ.get("PYTHONPATH", "")])
    env = os.environ | {"PYTHONPATH": path, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", module, model, str(out)]
    subprocess.run(cmd, env=env, check=True, timeout=1200)
    return json.loads(out.read_text())
