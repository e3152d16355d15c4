"""app/serve/reaper.py. HAProxyWatch: an HAProxy recorded while it was below `slimserve
serve` is killed at exit even after its parent died and left it to init; nothing else is.
LocalHead: the CLI's own Ray head is lost once one of its processes exits. A `sleep` run
through a symlink of a name of this test's own stands in for each (other tests' servers may
run real HAProxies below this process; no Ray here: the real case, a server stopped with its
whole process group, is tests/reliability/serve/test_haproxy.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import psutil
import pytest

from app.serve.reaper import HAProxyWatch, LocalHead, unless_lost


def stand_in(tmp_path, name: str) -> str:
    """`sleep`, run under the process name ``name``."""
    link = tmp_path / name
    link.symlink_to(shutil.which("sleep"))
    return str(link)


def grandchild(tmp_path, name: str) -> tuple[subprocess.Popen, int]:
    """`name` (a `sleep 60`) started in the background by a shell: this process's
    grandchild while the shell runs."""
    link = stand_in(tmp_path, name)
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


@pytest.fixture
def head(tmp_path):
    """Two stand-ins for a GCS and a raylet, children of this process, and their LocalHead."""
    name = f"head{os.getpid() % 100000}"
    link = stand_in(tmp_path, name)
    procs = [subprocess.Popen([link, "60"]) for _ in range(2)]
    yield LocalHead((name,)), procs
    for p in procs:
        p.kill()
        p.wait()


def test_the_head_is_lost_once_one_of_its_processes_exits(head):
    """Seen failing with lost() asking for every process gone (one died, the other ran)."""
    head, (gcs, raylet) = head
    assert not LocalHead(("nothing-here",)).lost(grace_s=0.1)  # none: not this CLI's Ray
    assert sorted(p.pid for p in head.procs) == sorted([gcs.pid, raylet.pid])
    assert not head.lost(grace_s=0.2)
    gcs.kill()
    assert head.lost(grace_s=0.2)


def test_a_step_is_left_once_the_head_is_lost_and_awaited_while_it_lives(head):
    """Seen failing with unless_lost() joining the step without watching the head (it
    awaited the blocked step's end and said True)."""
    head, (gcs, _) = head
    assert unless_lost(head, lambda: time.sleep(0.5), poll_s=0.05)
    with pytest.raises(ZeroDivisionError):
        unless_lost(head, lambda: 1 / 0, poll_s=0.05)
    blocked = threading.Event()  # a shutdown asking a dead GCS (Ray gives up after ~30 s)
    threading.Timer(0.3, gcs.kill).start()
    assert not unless_lost(head, lambda: blocked.wait(30), poll_s=0.05)
    blocked.set()
