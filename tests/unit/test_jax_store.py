"""``preemptible.jax``'s store over JAX's coordination service, against the real service of a
one-process ``jax.distributed`` (in a child process: initializing it is for the process's
whole life).

``test_jax_canary_*``: the private client the store reads (``jax._src.distributed.
global_state.client``) and the statuses it tells apart; a failure means the pinned jax moved:
read the new release and adapt ``preemptible/jax/_store.py``. The two processes that agree on a
stop through it are in tests/integration/test_jax.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.reference import free_port

pytest.importorskip("jax")

CANARY = """
import sys
import jax
from preemptible.jax._store import CoordinationStore, coordination_client

assert coordination_client() is None  # before initialize
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=1, process_id=0)
client = coordination_client()
for name in ("key_value_set_bytes", "blocking_key_value_get_bytes", "key_value_try_get_bytes",
             "key_value_delete"):
    assert callable(getattr(client, name, None)), f"the client has no {name}"
store = CoordinationStore(client, "t/", timeout=5)
assert not store.check(["a"])
store.set("a", "1")
store.set("a", b"2")  # overwritten, as a c10d store does
assert store.check(["a"]) and store.get("a") == b"2"
assert not store.check(["a", "b"])
assert store.compare_set("r", "", "first") == b"first"  # the first writer wins
assert store.compare_set("r", "", "second") == b"first"
assert store.delete_key("r") and not store.check(["r"])
assert store.compare_set("r", "", "third") == b"third"
other = CoordinationStore(client, "u/", timeout=5)
assert not other.check(["a"])  # prefixes keep loops apart
try:
    store.compare_set("r", "x", "y")
except ValueError:
    pass
else:
    raise AssertionError("compare_set with an expected value is refused")
print("canary ok")
"""


def test_jax_canary_the_coordination_store_over_the_real_service() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CANARY, str(free_port())],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "canary ok" in done.stdout, done.stdout + done.stderr


def test_jax_canary_the_version_is_the_pinned_one() -> None:
    import jax

    assert jax.__version__ == "0.10.2", "constraints.txt pins jax==0.10.2: re-run these"
