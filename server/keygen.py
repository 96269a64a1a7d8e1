"""`python -m server.keygen DIR`: an API key for a deployment that has none yet.

The replicas compose overlay runs it once before the servers start: vllm-router
rewrites `Host` to the worker's address, so behind it the keyless Host check
cannot see a DNS-rebinding page's name and only a key keeps the page out.

DIR receives, unless `api-keys` already exists (the key survives restarts):
- `api-keys`: `default KEY`, the `--api-keys` file (mode 0600, owned by --owner);
- `api-key`: the bare key, for a scraper's bearer credentials file (mode 0400, owned by --reader).
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from server.auth import DEFAULT_TENANT

KEYS_FILE = "api-keys"
BARE_KEY_FILE = "api-key"


def write_private(path: Path, text: str, mode: int, owner: int | None) -> None:
    """Create `path` (never through a link or over an existing file) with `mode` from the start."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
        if owner is not None:
            os.fchown(out.fileno(), owner, owner)


def generate(directory: Path, owner: int | None = None, reader: int | None = None) -> bool:
    """Write a fresh key into `directory`; False if one is there already."""
    if (directory / KEYS_FILE).exists():
        return False
    directory.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    write_private(directory / BARE_KEY_FILE, key + "\n", 0o400, reader)
    write_private(directory / KEYS_FILE, f"{DEFAULT_TENANT} {key}\n", 0o600, owner)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m server.keygen", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to write api-keys and api-key")
    parser.add_argument("--owner", type=int, default=None, help="uid (and gid) to own api-keys: the server's")
    parser.add_argument("--reader", type=int, default=None, help="uid (and gid) to own api-key: the scraper's")
    args = parser.parse_args(argv)
    made = generate(args.directory, args.owner, args.reader)
    state = "generated" if made else "already present"
    print(f"API key {state} in {args.directory / KEYS_FILE}; clients send 'Authorization: Bearer <key>'")


if __name__ == "__main__":
    main()
