"""One writer per run directory: the lease a `flashdraft train` holds on its output.

Two runs writing one directory (a job submitted twice, a copied config) would each overwrite
the other's config, metrics, checkpoints and export and both report success. So a run takes
`RUN/LOCK` before it writes anything and gives it back when it exits, however it exits:

    {"host": ..., "pid": ..., "started": ISO time, "refreshed": UNIX time, "token": uuid}

The lease works on a local disk and on object storage alike (any fsspec URL): it is written,
then read back after `SETTLE_S`; whoever's token is there holds it (a store that is not
strongly consistent for one object could let two racing writers both read their own token;
every object store flashdraft targets is). A holder refreshes `refreshed` every `REFRESH_S`
from a daemon thread (file I/O only: the training step never waits for it) and notices when
another run has taken the lease over.

A lease is stale, and taken over with a warning, when its holder is gone: on this host, its
process no longer exists; anywhere, it was not refreshed for `STALE_S` (a killed job on
another node, a preempted pod). `--take-over` takes a lease that looks alive, for the case
the rules cannot see (a holder hung for good). Only global rank 0 of a torchrun job takes it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from flashdraft import storage
from flashdraft.log import get_logger

log = get_logger(__name__)

LOCK = "LOCK"
REFRESH_S = 60.0  # how often a holder rewrites its lease
STALE_S = 600.0  # a lease not refreshed for this long is a dead holder's
SETTLE_S = 0.2  # between writing the lease and reading back who holds it
TAKE_OVER = "--take-over"  # the flag of `flashdraft train` that takes a live-looking lease


class RunLocked(FileExistsError):
    """Another run holds the run directory (a user error: one line, exit status 2)."""


def _read(url: str) -> dict[str, Any] | None:
    """The lease at `url`; None when there is none. A lease that does not parse (cut short
    by a crash mid-write) is a dead holder's: an empty dict."""
    if not storage.exists(url):
        return None
    try:
        lease = json.loads(storage.read_text(url) or "null")
    except (ValueError, OSError):
        return {}
    return lease if isinstance(lease, dict) else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def stale_because(lease: dict[str, Any], now: float | None = None) -> str | None:
    """Why a lease's holder is gone (None: it may be alive)."""
    now = time.time() if now is None else now
    try:
        host, pid, refreshed = str(lease["host"]), int(lease["pid"]), float(lease["refreshed"])
    except (KeyError, TypeError, ValueError):
        return "the lease does not parse (its writer was cut off)"
    if host == socket.gethostname() and pid != os.getpid() and not _alive(pid):
        return f"process {pid} no longer exists on {host}"
    if now - refreshed > STALE_S:
        return f"it was last refreshed {now - refreshed:,.0f} s ago (stale after {STALE_S:.0f} s)"
    return None


def describe(lease: dict[str, Any], now: float | None = None) -> str:
    """The holder in words: pid, host, start, last refresh."""
    now = time.time() if now is None else now
    try:
        ago = f"{now - float(lease['refreshed']):,.0f} s ago"
    except (KeyError, TypeError, ValueError):
        ago = "never"
    return (
        f"pid {lease.get('pid', '?')} on {lease.get('host', '?')}, started "
        f"{lease.get('started', '?')}, lease refreshed {ago}"
    )


class RunLock:
    """The lease on one run directory (a context manager; `enabled=False` holds nothing:
    the ranks of a torchrun job other than rank 0). `take_over`: take a lease that looks
    alive too (`--take-over`)."""

    def __init__(self, run: str, *, enabled: bool = True, take_over: bool = False) -> None:
        self.run, self.url = run, storage.join(run, LOCK)
        self.enabled, self.take_over = enabled, take_over
        self.token = uuid.uuid4().hex
        self.lost: dict[str, Any] | None = None  # the lease that replaced ours, if one did
        self._lease: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        if self.enabled:
            self.acquire()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self.enabled:
            self.release()

    def acquire(self) -> None:
        """Take the lease, or raise `RunLocked` naming its holder."""
        held = _read(self.url)
        if held is not None:
            why = stale_because(held)
            if why is None and not self.take_over:
                raise RunLocked(
                    f"{self.run} is being written by another run ({describe(held)}; lease "
                    f"{self.url}): wait for it to finish or choose another output; if that run "
                    f"is gone for good, pass {TAKE_OVER}"
                )
            log.warning(
                f"taking over the lease {self.url} of {describe(held)}: "
                f"{why or f'{TAKE_OVER} was given'}"
            )
        storage.makedirs(self.run)
        now = time.time()
        self._lease = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds"),
            "refreshed": now,
            "token": self.token,
        }
        if not (held is None and self._create_local()):
            storage.write_bytes_atomic(self.url, storage.json_bytes(self._lease))
            time.sleep(SETTLE_S)  # a racing writer's lease lands before we look
        winner = _read(self.url)
        if not winner or winner.get("token") != self.token:
            raise RunLocked(
                f"{self.run} was locked by another run starting at the same time "
                f"({describe(winner or {})}; lease {self.url}); choose another output"
            )
        self._thread = threading.Thread(target=self._refresh, name="flashdraft-lock", daemon=True)
        self._thread.start()

    def _create_local(self) -> bool:
        """On a local disk, create the lease exclusively (two runs starting together cannot
        both win); False elsewhere, or when another run's lease landed first (the read-back
        names it)."""
        if not storage.is_local(self.url):
            return False
        try:
            fd = os.open(
                storage.filesystem(self.url)[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
            )
        except FileExistsError:
            return True
        with os.fdopen(fd, "wb") as f:
            f.write(storage.json_bytes(self._lease))
        return True

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                held = _read(self.url)
                if held is not None and held.get("token") != self.token:
                    self.lost = held
                    log.error(
                        f"the lease {self.url} was taken over by {describe(held)}: this run "
                        "no longer holds its run directory"
                    )
                    return
                self._lease["refreshed"] = time.time()
                storage.write_bytes_atomic(self.url, storage.json_bytes(self._lease))
            except OSError as err:  # a store hiccup: try again at the next refresh
                log.warning(f"could not refresh the lease {self.url}: {err}")

    def release(self) -> None:
        """Stop refreshing and remove the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:
            held = _read(self.url)
            if held is not None and held.get("token") == self.token:
                fs, path = storage.filesystem(self.url)
                fs.rm(path)
        except OSError as err:
            log.warning(f"could not remove the lease {self.url}: {err}")
