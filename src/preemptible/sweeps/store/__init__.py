"""The sweep queue: sweeps, their runs and every attempt, in SQLite or PostgreSQL (with the SQL
text in ``sql/``); the claims, leases and endings agents agree on through it."""

from __future__ import annotations

from ._claims import target_reached
from ._connector import DEFAULT_RETRY_TIMEOUT, _Tx
from ._endings import LEASE_EXPIRED, takeover_margin
from ._fields import DECODER, decode_object, field_error
from ._local import HostView
from ._metrics import SLICE_SECONDS, HistoryCopy
from ._pause import CtrlZ
from ._queue import Store, open_store
from ._rows import AttemptRow, Claim
from ._values import _metric, clean_step

__all__ = [
    "DECODER",
    "DEFAULT_RETRY_TIMEOUT",
    "LEASE_EXPIRED",
    "SLICE_SECONDS",
    "AttemptRow",
    "Claim",
    "CtrlZ",
    "HistoryCopy",
    "HostView",
    "Store",
    "_Tx",
    "_metric",
    "clean_step",
    "decode_object",
    "field_error",
    "open_store",
    "takeover_margin",
    "target_reached",
]
