"""Tensor/expert-parallel tests: rank 0 is the pytest process, workers are forked from a
forkserver (one import of torch for the session instead of one per replica)."""

import os

import pytest
import torch

os.environ.setdefault("SLIMSERVE_TP_START_METHOD", "forkserver")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)  # ranks share two cores; oversubscription makes torch crawl


@pytest.fixture(scope="session")
def moe_factory(tmp_path_factory):
    """family -> tiny GLM-4.5 / DeepSeek-V3 checkpoint (tests/models/moe_checkpoints.py)."""
    from tests.models.moe_checkpoints import make_moe_checkpoint

    made = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = make_moe_checkpoint(family, str(tmp_path_factory.mktemp(family)))
        return made[family]

    return get
