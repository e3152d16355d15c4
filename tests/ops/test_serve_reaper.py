"""HAProxyWatch (app/serve/reaper.py): an HAProxy recorded while it was below `slimserve
serve` is killed at exit even after its parent died and left it to init; nothing else is.
A `sleep` run through a symlink of a name of this test's own stands in for it (other tests'
servers may run real HAProxies below this process; no Ray here: the real case, a server
stopped with its whole process group, is tests/reliability/serve/test_haproxy.py)."""

from __future__ import annotations

import os
import shutil
import subprocess

import psutil

from app.serve.reaper import HAProxyWatch


def grandchild(tmp_path, name: str) -> tuple[subprocess.Popen, int]:
    """`name` (a `sleep 60`) started in the background by a shell: this process's
    grandchild while the shell runs."""
    link = tmp_path / name
    link.symlink_to(shutil.which("sleep"))
    sh = subprocess.Popen(["sh", "-c", f"{link} 60 & echo $!; wait"], stdout=subprocess.PIPE)
    return sh, int(sh.stdout.readline())


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_orphaned_haproxy_is_killed_and_others_are_left(tmp_path):
    """Seen failing with stop() killing only what is below this process at exit: the
    orphan lived on."""
    name = f"hap{os.getpid() % 100000}"  # process names keep 15 characters
    sh, proxy = grandchild(tmp_path, name)
    other_sh, other = grandchild(tmp_path, name + "x")
    try:
        watch = HAProxyWatch(name)
        watch.update()
        sh.kill()
        sh.wait()  # the proxy is orphaned: no longer below this process
        below = {p.pid for p in psutil.Process().children(recursive=True)}
        assert proxy not in below and not gone(proxy)
        assert watch.stop() == [proxy]
        assert gone(proxy) and not gone(other)
        assert watch.stop() == []  # nothing left to kill
    finally:
        for pid in (proxy, other):
            if not gone(pid):
                psutil.Process(pid).kill()
        other_sh.kill()
        other_sh.wait()
