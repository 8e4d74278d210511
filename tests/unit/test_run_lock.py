"""The run's lock names its holder so that a process another pid namespace holds is never
taken for gone (``supervisor/_lock.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

from preemptible.supervisor._lock import _gone, identity


def test_a_holder_is_gone_only_when_this_namespace_shows_it_ended() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    me = identity()
    assert not _gone(me)  # alive
    pid, who = me.splitlines()
    boot, namespace, _, start = who.split("/")
    dead = f"{child.pid}\n{boot}/{namespace}/{child.pid}/{start}\n"
    assert _gone(dead)  # this boot and namespace, no such process (or another one now)
    assert not _gone(f"{pid}\n{boot}/pid:[1]/{pid}/{start}\n")  # another pid namespace
    assert not _gone(f"{child.pid}\nother-boot/{namespace}/{child.pid}/{start}\n")
    assert not _gone(f"{child.pid}\n")  # an older file: where that pid lives is unknown
    assert not _gone("")
    assert pid == str(os.getpid())
