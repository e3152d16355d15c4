"""Fixtures shared by the reliability suite (docs/reliability.md)."""

import pytest

# Thousands of tokens of context, so a request asked for `LONG_TOKENS` cannot end on its own
# while a test waits for its abort.
LONG_CONTEXT = 8192
LONG_TOKENS = 6000


@pytest.fixture(scope="session")
def long_model(checkpoint_factory):
    """The tiny llama with an 8k context (room for requests that run for a long time)."""
    return checkpoint_factory("llama", max_position_embeddings=LONG_CONTEXT)
