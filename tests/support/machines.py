"""A machine of its own for the child processes of a new-machine test.

A spot VM or a pod that is reclaimed takes its disks with it: the working directory, ``HOME``
(where the staging directory of a bucket's checkpoints lives, under ``~/.cache``) and
``TMPDIR``. A ``Machine`` is those three, new, for the processes a test starts "on" it
(``cwd=machine.cwd, env=machine.env``); ``gone()`` deletes them all, so that what runs next on
another machine can only find what reached the bucket.
"""

from __future__ import annotations

import shutil
from pathlib import Path


class Machine:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.cwd = root / "work"
        self.home = root / "home"
        self.tmp = root / "tmp"
        for d in (self.cwd, self.home, self.tmp):
            d.mkdir(parents=True)

    @property
    def env(self) -> dict[str, str]:
        """The variables that point a child at this machine's disks (an exported
        ``PREEMPTIBLE_STAGING_DIR`` or ``XDG_CACHE_HOME`` would be shared by every machine)."""
        return {
            "HOME": str(self.home),
            "TMPDIR": str(self.tmp),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "PREEMPTIBLE_STAGING_DIR": "",  # empty: not given
        }

    def gone(self) -> None:
        """The machine is reclaimed: nothing it wrote locally is left."""
        shutil.rmtree(self.root)
        assert not self.root.exists()
