"""The sweep database's SQL text, as procrastinate keeps it: named queries in ``sql/queries.sql``
(and a backend's own in ``sql/<kind>/queries.sql``), the schema as versioned migrations
``sql/<kind>/NNNN_name.sql``, applied once by ``migrate``."""

from __future__ import annotations

import re
from importlib import resources

from ..._errors import PreemptibleError, StoreError
from ._connector import Connector, _Tx

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def _parse_queries(text: str) -> dict[str, str]:
    pieces = _NAME.split(text)
    return {name: body.strip() for name, body in zip(pieces[1::2], pieces[2::2], strict=True)}


def _load_queries(kind: str) -> dict[str, str]:
    sql = resources.files("preemptible.sweeps.store").joinpath("sql")
    common = _parse_queries(sql.joinpath("queries.sql").read_text(encoding="utf-8"))
    own = _parse_queries(sql.joinpath(kind).joinpath("queries.sql").read_text(encoding="utf-8"))
    clash = sorted(set(common) & set(own))
    if clash:
        raise StoreError(f"queries {clash} are defined twice for {kind}")
    return {**common, **own}


def migrations(kind: str) -> list[tuple[int, str]]:
    """(version, SQL) for every ``NNNN_name.sql`` of the backend, in order."""
    folder = resources.files("preemptible.sweeps.store").joinpath("sql").joinpath(kind)
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_\w+\.sql", entry.name)
        if match:
            found.append((int(match.group(1)), entry.read_text(encoding="utf-8")))
    return sorted(found)


def split_statements(script: str) -> list[str]:
    """Statements of a migration: ``;`` ends one at the end of a line; ``--`` lines are
    comments. (The drivers run one statement per call inside a transaction.)"""
    lines = [ln for ln in script.splitlines() if not ln.lstrip().startswith("--")]
    return [s.strip() for s in re.split(r";[ \t]*$", "\n".join(lines), flags=re.M) if s.strip()]


def migrate(db: Connector, *, reader: bool = False) -> None:
    """Apply the migrations this database lacks, one migrator at a time (SQLite: the write
    lock; PostgreSQL: an advisory lock), so agents opening a new database together agree.
    A ``reader`` that may not write reads a database whose schema is current as it is."""
    wanted = migrations(db.backend.kind)
    if reader:
        try:
            migrate(db)
        except StoreError as refused:
            try:
                have = db.transact(
                    lambda tx: {r["version"] for r in tx.all("schema_versions")}, write=False
                )
            except PreemptibleError:
                raise refused from None
            if have and max(have) > wanted[-1][0]:
                raise  # a newer schema: "upgrade preemptible"
            if not have.issuperset(v for v, _ in wanted):
                raise StoreError(
                    f"{refused}; it has schema version {max(have, default=0)} and this "
                    f"preemptible reads version {wanted[-1][0]}: migrate it once where it "
                    "can be written (any preemptible command does)"
                ) from None
        return

    def apply(tx: _Tx) -> None:
        tx.run("migration_lock")
        tx.run("create_schema_table")
        have = {row["version"] for row in tx.all("schema_versions")}
        newest = max(v for v, _ in wanted)
        if have and max(have) > newest:
            raise StoreError(
                f"the sweep database {db.display} has schema version {max(have)}; this "
                f"preemptible knows up to {newest}: upgrade preemptible"
            )
        for version, script in wanted:
            if version not in have:
                for statement in split_statements(script):
                    tx.execute(statement)
                tx.run("record_version", version=version)

    db.transact(apply)
