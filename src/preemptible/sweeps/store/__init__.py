"""The sweep queue: sweeps, their runs and every attempt, in SQLite or PostgreSQL (with the SQL
text in ``sql/``); the claims, leases and endings agents agree on through it."""

from __future__ import annotations
