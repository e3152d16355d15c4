"""No pickle loads under app/: bytes read from sockets (the delta channel, the KV store)
are decoded by typed msgpack schemas, never unpickled. Ray's own transport pickles inside
Ray; this project's code must not. Seen failing on the old delta_wire.py (pickle.loads)."""

from __future__ import annotations

import re
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"
FORBIDDEN = re.compile(r"pickle\.loads|pickle\.load\(|cloudpickle\.loads|Unpickler")


def test_nothing_under_app_unpickles():
    hits = [
        f"{path.relative_to(APP.parent)}:{number}: {line.strip()}"
        for path in sorted(APP.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert not hits, "pickle loads under app/:\n" + "\n".join(hits)
