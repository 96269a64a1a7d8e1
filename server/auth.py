"""Credentials and tenants: who may call the API, and whose caches a request may share.

A tenant is an isolation domain: requests share cached prompt prefixes (the KV
blocks behind `usage.prompt_tokens_details.cached_tokens`) and cross-request
drafts (suffix decoding's outputs, hence the speculation counts) only within
one tenant. The tenant comes from the credential, never from the request body:

- `--api-keys FILE`: one `TENANT KEY` pair per line (`#` comments); a request's
  bearer key names its tenant. Several keys may share a tenant. The file must not
  be readable by group or others, and is re-read when it changes (`KeyRing`).
- `--api-key KEY` (better `SPECD_API_KEY`: a flag shows in the process list): one
  key of 8+ characters, one tenant (`default`).
- no key: one tenant; every client shares every cache (a single-user server).

Within its tenant a request may narrow sharing further with `cache_salt`
(vLLM's field): its caches are then keyed by (tenant, salt). `user`, a
non-secret end-user id in OpenAI's API, isolates nothing.

Keys are compared with `secrets.compare_digest` against every configured key,
whichever matches, so the time taken says nothing about which one is close.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from server.private_files import shared_mode

logger = logging.getLogger("specd.server")

DEFAULT_TENANT = "default"
RECHECK_SECONDS = 1.0  # how often the keys file's stat is compared
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
MIN_KEY_CHARS = 8


class CredentialsError(ValueError):
    """An --api-keys file that cannot be used; the message names the line."""


@dataclass(frozen=True)
class Credentials:
    """Bearer keys and the tenant each one names; empty: no authentication, one tenant."""

    keys: tuple[tuple[bytes, str], ...] = ()  # (b"Bearer KEY", tenant)

    @property
    def required(self) -> bool:
        return bool(self.keys)

    @property
    def tenants(self) -> set[str]:
        return {tenant for _, tenant in self.keys}

    def tenant_for(self, authorization: bytes) -> str | None:
        """The tenant of an `Authorization` header's value, None if it matches no key. Every key
        is compared, in constant time each, whatever the first match."""
        found = None
        for expected, tenant in self.keys:
            if secrets.compare_digest(authorization, expected) and found is None:
                found = tenant
        return found

    @classmethod
    def load(cls, api_key: str | None = None, api_keys_file: Path | None = None) -> Credentials:
        pairs: list[tuple[str, str]] = []
        if api_key:
            if len(api_key) < MIN_KEY_CHARS or not api_key.isprintable():
                raise CredentialsError(f"--api-key: a key has {MIN_KEY_CHARS}+ printable characters")
            pairs.append((DEFAULT_TENANT, api_key))
        if api_keys_file is not None:
            pairs += read_keys_file(api_keys_file)
        seen: set[str] = set()
        for _, key in pairs:
            if key in seen:
                raise CredentialsError("the same API key is given twice (one key names one tenant)")
            seen.add(key)
        return cls(tuple((f"Bearer {key}".encode(), tenant) for tenant, key in pairs))


def read_keys_file(path: Path) -> list[tuple[str, str]]:
    """(tenant, key) pairs of an --api-keys file, refused where group or others may read or write it."""
    try:
        info = os.stat(path)
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialsError(f"--api-keys {path}: {exc.strerror}") from exc
    if problem := shared_mode(info, f"--api-keys {path}"):
        raise CredentialsError(problem)
    pairs = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise CredentialsError(f"--api-keys {path}, line {number}: expected 'TENANT KEY'")
        tenant, key = parts
        if not TENANT_NAME.fullmatch(tenant):
            raise CredentialsError(
                f"--api-keys {path}, line {number}: a tenant name is 1-64 letters, digits, '_', '.', '@' or '-'"
            )
        if len(key) < MIN_KEY_CHARS or not key.isprintable():
            raise CredentialsError(f"--api-keys {path}, line {number}: a key has {MIN_KEY_CHARS}+ printable characters")
        pairs.append((tenant, key))
    if not pairs:
        raise CredentialsError(f"--api-keys {path} holds no key")
    return pairs


class KeyRing:
    """The credentials in force, re-read when the --api-keys file changes (mtime, size or inode:
    an edit, or a new file moved into place) or on SIGHUP (`reload`), so keys are added and
    revoked without a restart.
    A changed file that cannot be used is logged and the keys in force stay."""

    def __init__(self, api_key: str | None = None, api_keys_file: Path | None = None):
        self.api_key, self.path = api_key, api_keys_file
        self.credentials = Credentials.load(api_key, api_keys_file)
        self._stamp = self._file_stamp()
        self._checked = time.monotonic()

    def current(self) -> Credentials:
        now = time.monotonic()
        if self.path is None or now - self._checked < RECHECK_SECONDS:
            return self.credentials
        self._checked = now
        stamp = self._file_stamp()
        if stamp != self._stamp:
            self._stamp = stamp
            self._load("changed")
        return self.credentials

    def reload(self) -> None:
        """Re-read the keys file now, changed or not (SIGHUP: an edit within the same second and
        size as the last one leaves the stamp as it was)."""
        if self.path is not None:
            self._stamp, self._checked = self._file_stamp(), time.monotonic()
            self._load("reloaded")

    def _load(self, why: str) -> None:
        try:
            self.credentials = Credentials.load(self.api_key, self.path)
            logger.info("--api-keys %s %s: %d keys in force", self.path, why, len(self.credentials.keys))
        except CredentialsError as exc:
            logger.error("%s; the keys loaded before stay in force", exc)

    def _file_stamp(self) -> tuple[int, int, int] | None:
        if self.path is None:
            return None
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size, info.st_ino
