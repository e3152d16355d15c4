"""The grammar engine behind structured outputs: xgrammar, imported only when a request asks.

slimserve runs without xgrammar installed; a request for structured output then fails with
StructuredOutputError naming the missing extra, and nothing else changes.
"""

from __future__ import annotations

import re
from types import ModuleType


class StructuredOutputError(ValueError):
    """A structured-output request that cannot be served: a bad schema, regex or grammar, an
    unsupported feature, or no grammar engine installed. The message names the problem."""


_xgr: ModuleType | None = None


def xgrammar() -> ModuleType:
    global _xgr
    if _xgr is None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise StructuredOutputError(
                "structured outputs need xgrammar, which is not installed on this server "
                "(pip install 'slimserve[structured]')"
            ) from None
        _xgr = xgr
    return _xgr


# xgrammar's C++ errors read "[10:00:00] /project/cpp/file.cc:83: Check failed: ...: <why>".
_CPP_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*(Check failed:[^:]*:\s*)?")


def clean_message(e: BaseException) -> str:
    """The reason part of an xgrammar error, without its C++ source location."""
    text = str(e).strip()
    return _CPP_PREFIX.sub("", text).strip() or type(e).__name__
