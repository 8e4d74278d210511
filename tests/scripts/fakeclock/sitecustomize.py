"""A stepped wall clock for the clock-step tests: on PYTHONPATH, every Python process of the
"host" (an agent, its runs) sees ``time.time()`` moved by the seconds written in the file that
``FAKE_CLOCK_OFFSET_FILE`` names; rewriting the file steps the clock. CLOCK_MONOTONIC is left
alone, as a real step of the system clock leaves it (NTP, ``date -s``).

libfaketime cannot do this here: Debian's 0.9.10 with Python 3.11+ fails every
``time.sleep`` with EINVAL when it leaves the monotonic clock alone (libfaketime issue 426),
and when it fakes it, a step moves the monotonic clock too, which no real step does.
"""

from __future__ import annotations

import os
import time

_FILE = os.environ.get("FAKE_CLOCK_OFFSET_FILE")

if _FILE:
    _real_time, _real_time_ns, _monotonic = time.time, time.time_ns, time.monotonic
    _cache = [0.0, -1.0]  # offset, when read (monotonic)

    def _offset() -> float:
        now = _monotonic()
        if now - _cache[1] > 0.05:
            try:
                with open(_FILE, encoding="ascii") as fh:
                    _cache[0] = float(fh.read().strip() or 0)
            except (OSError, ValueError):
                pass
            _cache[1] = now
        return _cache[0]

    def _time() -> float:
        return _real_time() + _offset()

    def _time_ns() -> int:
        return _real_time_ns() + int(_offset() * 1e9)

    time.time = _time
    time.time_ns = _time_ns
