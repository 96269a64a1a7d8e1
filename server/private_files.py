"""Secrets the server reads from files (the --api-keys file, KV-event CURVE keys): refused where
group or others may read or write them, one rule for every such file."""

from __future__ import annotations

import os
import stat

_SHARED = stat.S_IRWXG | stat.S_IRWXO


def shared_mode(info: os.stat_result, what: str) -> str | None:
    """Why `what` (a flag and its path) is not private to its owner, or None where it is."""
    if info.st_mode & _SHARED:
        return f"{what}: readable or writable by group or others (mode {info.st_mode & 0o777:o}); chmod 600 it"
    return None
