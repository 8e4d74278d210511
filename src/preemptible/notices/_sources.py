"""Notice sources: each ``poll()`` returns a Notice, None, or raises on a bad answer.

Every request has a total deadline (``timeout``) and runs in the watcher's background thread;
an unreachable, slow, dripping, redirecting, failing or garbage-answering server raises, the
composite watcher logs that once per source, and polling goes on.

Each source has a ``display``: where it looks, without credentials, for every message.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import shutil
import stat
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from .._env import env_float, env_str
from .._errors import ConfigError, NoticeError
from ..stop._termination import Notice
from ._http import Endpoint, parse_endpoint, request

logger = logging.getLogger("preemptible")

GCE_SPOT_NOTICE = 30.0
GCE_MAINTENANCE_NOTICE = 60.0
METADATA_IP = "169.254.169.254"


class Source(Protocol):
    name: str
    display: str

    def poll(self) -> Notice | None: ...


def _iso_time(text: str) -> float:
    """'2026-11-29T19:41:00Z' (EC2) -> epoch seconds."""
    return datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp()


def _endpoint(given: str | None, var: str, default: str) -> Endpoint:
    if given is not None:
        return parse_endpoint(given, "endpoint")
    return parse_endpoint(env_str(var) or default, var)


def gce_notice_seconds() -> float:
    """``PREEMPTIBLE_GCE_NOTICE_SECONDS``: the window a GCE Spot notice gives."""
    seconds = env_float("PREEMPTIBLE_GCE_NOTICE_SECONDS", GCE_SPOT_NOTICE)
    return GCE_SPOT_NOTICE if seconds is None else seconds


class GCE:
    """GCE: ``instance/preempted`` (Spot/preemptible) and ``instance/maintenance-event``.

    Both are checked: a watcher that only looks at maintenance events misses Spot preemption.
    """

    name = "gce"

    def __init__(self, host: str | None = None, timeout: float = 2.0) -> None:
        self._endpoint = _endpoint(host, "GCE_METADATA_HOST", "metadata.google.internal")
        self.base = self._endpoint.base + "/computeMetadata/v1/instance/"
        self.display = self.base
        self.timeout = timeout
        self.notice_seconds = gce_notice_seconds()
        self._clear_at: float | None = None  # when the last poll that saw nothing started

    def _get(self, key: str) -> str:
        headers = self._endpoint.headers({"Metadata-Flavor": "Google"})
        resp = request("GET", self.base + key, headers=headers, timeout=self.timeout)
        if resp.status != 200:
            raise NoticeError(f"GET {self.base}{key}: HTTP {resp.status}")
        return resp.body.strip()

    def poll(self) -> Notice | None:
        # GCE's notices carry no time: the window may have started any time since the last
        # poll that saw nothing, so the deadline counts from there (detection_latency); with
        # no such poll (the VM was already going down when we started), from now - window.
        started = time.time()
        preempted = self._get("preempted")
        if preempted == "TRUE":
            return self._notice(
                started, self.notice_seconds, "GCE preempted this Spot/preemptible VM"
            )
        if preempted != "FALSE":
            raise NoticeError(f"instance/preempted answered {preempted[:80]!r}, not TRUE/FALSE")
        event = self._get("maintenance-event")
        if event == "TERMINATE_ON_HOST_MAINTENANCE":
            return self._notice(
                started, GCE_MAINTENANCE_NOTICE, "GCE host maintenance will terminate this VM"
            )
        if event not in ("NONE", "MIGRATE_ON_HOST_MAINTENANCE"):
            raise NoticeError(f"instance/maintenance-event answered {event[:80]!r}")
        self._clear_at = started
        return None

    def _notice(self, started: float, window: float, detail: str) -> Notice:
        clear_at = self._clear_at
        latency = window if clear_at is None else max(started - clear_at, 0.0)
        return Notice(
            source="gce",
            deadline=started + window,
            detection_latency=min(latency, window),
            detail=detail,
        )


class EC2:
    """EC2 with IMDSv2: Spot interruption (a stop with the deadline AWS gives) and the
    rebalance recommendation (an early warning: insurance checkpoint, keep training)."""

    name = "ec2"
    TOKEN_TTL = 21600

    def __init__(self, endpoint: str | None = None, timeout: float = 2.0) -> None:
        self._endpoint = _endpoint(
            endpoint, "AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://{METADATA_IP}"
        )
        self.base = self._endpoint.base
        self.display = self.base
        self.timeout = timeout
        self._token: str | None = None
        self._token_expires = 0.0
        self._warned = False

    def _token_header(self) -> dict[str, str]:
        if self._token is None or time.monotonic() > self._token_expires:
            resp = request(
                "PUT",
                self.base + "/latest/api/token",
                headers=self._endpoint.headers(
                    {"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL)}
                ),
                timeout=self.timeout,
            )
            if resp.status != 200 or not resp.body.strip():
                raise NoticeError(f"PUT {self.base}/latest/api/token: HTTP {resp.status}")
            self._token = resp.body.strip()
            self._token_expires = time.monotonic() + self.TOKEN_TTL - 60
        return self._endpoint.headers({"X-aws-ec2-metadata-token": self._token})

    def _get(self, path: str) -> tuple[int, str]:
        for _ in range(2):
            resp = request(
                "GET", self.base + path, headers=self._token_header(), timeout=self.timeout
            )
            if resp.status == 401:  # the token expired or was revoked: get a new one, once
                self._token = None
                continue
            return resp.status, resp.body
        raise NoticeError(f"GET {self.base}{path}: HTTP 401 even with a fresh token")

    def poll(self) -> Notice | None:
        status, body = self._get("/latest/meta-data/spot/instance-action")
        if status == 200:
            try:
                action = json.loads(body)
                deadline = _iso_time(action["time"])
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise NoticeError(f"spot/instance-action answered {body[:80]!r}") from exc
            return Notice(
                source="ec2",
                deadline=deadline,
                detail=f"EC2 Spot interruption: {action.get('action')} at {action['time']}",
            )
        if status != 404:
            raise NoticeError(f"spot/instance-action: HTTP {status}")
        if not self._warned:
            status, body = self._get("/latest/meta-data/events/recommendations/rebalance")
            if status == 200:
                self._warned = True
                return Notice(
                    source="ec2-rebalance",
                    stop=False,
                    detail=f"EC2 rebalance recommendation {body.strip()[:80]}",
                )
            if status != 404:
                raise NoticeError(f"events/recommendations/rebalance: HTTP {status}")
        return None


class Azure:
    """Azure Scheduled Events: a Preempt or Terminate event is a stop with deadline NotBefore;
    the event is acknowledged (StartRequests) after the final checkpoint."""

    name = "azure"
    PATH = "/metadata/scheduledevents?api-version=2020-07-01"
    STOPS = ("Preempt", "Terminate")

    def __init__(self, endpoint: str | None = None, timeout: float = 2.0) -> None:
        self._endpoint = _endpoint(
            endpoint, "PREEMPTIBLE_AZURE_METADATA_ENDPOINT", f"http://{METADATA_IP}"
        )
        self.url = self._endpoint.base + self.PATH
        self.display = self.url
        self.timeout = timeout

    def poll(self) -> Notice | None:
        headers = self._endpoint.headers({"Metadata": "true"})
        resp = request("GET", self.url, headers=headers, timeout=self.timeout)
        if resp.status != 200:
            raise NoticeError(f"GET {self.url}: HTTP {resp.status}")
        try:
            events = json.loads(resp.body)["Events"]
            for event in events:
                if event.get("EventType") in self.STOPS:
                    return self._notice(event)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise NoticeError(f"scheduledevents answered {resp.body[:80]!r}") from exc
        return None

    def _notice(self, event: dict[str, Any]) -> Notice:
        not_before = event.get("NotBefore") or ""
        parsed = email.utils.parsedate_to_datetime(not_before) if not_before else None
        event_id = str(event["EventId"])

        def acknowledge() -> None:
            body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
            resp = request(
                "POST",
                self.url,
                data=body,
                timeout=self.timeout,
                headers=self._endpoint.headers(
                    {"Metadata": "true", "Content-Type": "application/json"}
                ),
            )
            if resp.status != 200:
                raise NoticeError(f"acknowledging event {event_id}: HTTP {resp.status}")

        return Notice(
            source="azure",
            deadline=parsed.timestamp() if parsed else time.time(),
            detail=f"Azure {event['EventType']} event {event_id} not before {not_before or 'now'}",
            acknowledge=acknowledge,
        )


class SlurmTimeLimit:
    """The job's end time as a deadline: a time limit can be saved for even without
    ``--signal``. The notice goes out ``lead`` seconds before the end; the grace policy then
    keeps training until the last safe moment."""

    name = "slurm"

    def __init__(
        self, job_id: str, lead: float = 300.0, refresh: float = 60.0, margin: float = 10.0
    ) -> None:
        self.job_id = job_id
        self.display = f"SLURM job {job_id}"
        self.lead = lead
        self.margin = margin
        self.refresh = refresh
        self._end: float | None = None
        self._read_at = -float("inf")

    def end_time(self) -> float | None:
        scontrol = shutil.which("scontrol")
        if scontrol is None:
            raise NoticeError("scontrol is not on PATH")
        out = subprocess.run(
            [scontrol, "show", "job", "-o", self.job_id], capture_output=True, text=True, timeout=10
        )
        if out.returncode != 0:
            raise NoticeError(f"scontrol show job {self.job_id}: {out.stderr.strip()[:120]}")
        fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
        if fields.get("TimeLimit") in (None, "UNLIMITED", "Partition_Limit"):
            return None
        end = fields.get("EndTime", "Unknown")
        if end in ("Unknown", "None"):
            return None
        return datetime.fromisoformat(end).timestamp()  # SLURM prints local time

    def poll(self) -> Notice | None:
        now = time.monotonic()
        if now - self._read_at >= self.refresh:
            self._read_at = now
            self._end = self.end_time()  # limits can be changed while the job runs
        if self._end is not None and time.time() >= self._end - self.lead:
            return Notice(
                source="slurm-time-limit",
                # done a little before the limit: SLURM's SIGTERM may come early, its SIGKILL
                # follows KillWait later, and the supervisor still has to requeue the job
                deadline=self._end - self.margin,
                detail=f"SLURM job {self.job_id} reaches its time limit at "
                f"{datetime.fromtimestamp(self._end).isoformat(timespec='seconds')}",
            )
        return None


class StopFile:
    """``PREEMPTIBLE_STOP_FILE``: a regular file there (or a symlink to one) asks for a stop.

    The file is removed when the notice is taken, so the resumed run does not stop again at
    once. A directory or other non-file there is not a request: refused when the source is
    made, a NoticeError when one appears later. When the file cannot be removed (a read-only
    directory, another user's file in a sticky /tmp), it still stops the run once, and a
    file that was already there, unchanged, when this source was made (the resumed run) is
    ignored until it is touched again: a stop request that cannot be taken away must not
    stop every later attempt at step 0.
    """

    name = "stop-file"
    VAR = "PREEMPTIBLE_STOP_FILE"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.display = str(self.path)
        try:
            found = self._stat()
        except OSError:
            found = None  # unreadable for now: poll() says so, once
        if found is not None and not stat.S_ISREG(found.st_mode):
            raise ConfigError(
                f"{self.VAR}={self.display!r} is not valid: it is {_kind(found)}; name a file "
                "(that need not exist yet) to touch when the run should stop"
            )
        self._before = _identity(found)
        self._taken: tuple[int, int, int] | None = None
        self._logged: tuple[int, int, int] | None = None

    def _stat(self) -> os.stat_result | None:
        try:
            return self.path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def poll(self) -> Notice | None:
        found = self._stat()
        if found is None:
            return None
        if not stat.S_ISREG(found.st_mode):
            raise NoticeError(f"{self.display} is {_kind(found)}, not a file: not a stop request")
        identity = _identity(found)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass  # taken at the same moment by another watcher (another rank): still a stop
        except OSError as exc:
            if identity in (self._before, self._taken):
                if self._logged != identity:
                    self._logged = identity
                    logger.warning(
                        "preemptible: ignoring %s: it cannot be removed (%s) and was there "
                        "before this run started; touch it again to stop this run",
                        self.display,
                        exc.strerror or exc,
                    )
                return None
            self._taken = self._logged = identity
            logger.warning(
                "preemptible: %s cannot be removed (%s); it stops this run once, and a resumed "
                "run ignores it until it is touched again",
                self.display,
                exc.strerror or exc,
            )
        return Notice(source="stop-file", detail=f"{self.display} appeared")


def _identity(found: os.stat_result | None) -> tuple[int, int, int] | None:
    return None if found is None else (found.st_dev, found.st_ino, found.st_mtime_ns)


def _kind(found: os.stat_result) -> str:
    return "a directory" if stat.S_ISDIR(found.st_mode) else "not a regular file"


class Composite:
    """Polls every source in turn; the first notice wins. Failures are logged once per source
    (their messages show ``display`` forms only, never credentials)."""

    def __init__(self, sources: list[Source]) -> None:
        self.sources = sources
        self._failed: set[str] = set()

    def __call__(self) -> Notice | None:
        for source in self.sources:
            try:
                notice = source.poll()
            except Exception as exc:
                if source.name not in self._failed:
                    self._failed.add(source.name)
                    logger.warning(
                        "preemptible: %s notices unavailable for now (%s: %s); logged once, "
                        "polling goes on",
                        source.name,
                        type(exc).__name__,
                        exc,
                    )
                continue
            if notice is not None:
                return notice
        return None
