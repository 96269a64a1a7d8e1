"""API keys (`server/auth.py`): compared by `secrets.compare_digest` alone, every key of a keys
file whichever matches; a short key, a bad line or a file others may read refused at start-up; the
file re-read when it changes and on SIGHUP; /metrics closed by default where a key is set; what
/ready and the server-wide views tell whom."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import pytest

import server.auth
from server.app import _on_sighup, create_app
from server.config import Settings
from tests.support.server import in_process


async def test_metrics_needs_the_key_unless_told_otherwise():
    async with in_process(api_key="k" * 8) as http:  # a key configured: /metrics is closed by default
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics", headers={"Authorization": "Bearer wrong"})).status_code == 401
        assert (await http.get("/metrics", headers={"Authorization": "Bearer " + "k" * 8})).status_code == 200
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/ready")).status_code == 503  # loading (no model here), not 401
    async with in_process(api_key="k" * 8, metrics_auth=False) as http:  # --no-metrics-auth: an explicit choice
        assert (await http.get("/metrics")).status_code == 200
    async with in_process() as http:  # no key anywhere (a loopback server): nothing to ask for
        assert (await http.get("/metrics")).status_code == 200
    with pytest.raises(ValueError, match="--metrics-auth needs an API key"):
        Settings(model="unused", metrics_auth=True)


@pytest.mark.parametrize("verdict", ["honest", "always-true", "always-false"])
async def test_the_key_is_judged_by_compare_digest_alone(monkeypatch, verdict):
    """A spy replaces compare_digest: every decision follows its answer, so no other
    (timing-leaky) comparison takes part, and it sees the whole header every time."""
    real = server.auth.secrets.compare_digest
    calls = []

    def spy(given, expected):
        calls.append((given, expected))
        return {"honest": real(given, expected), "always-true": True, "always-false": False}[verdict]

    monkeypatch.setattr(server.auth.secrets, "compare_digest", spy)
    async with in_process(api_key="s3cret-key") as http:
        right = await http.get("/v1/models", headers={"Authorization": "Bearer s3cret-key"})
        wrong = await http.get("/v1/models", headers={"Authorization": "Bearer guess"})
        missing = await http.get("/v1/models")
    passed = {"honest": (True, False, False), "always-true": (True, True, True), "always-false": (False, False, False)}
    assert tuple(r.status_code != 401 for r in (right, wrong, missing)) == passed[verdict]
    expected = b"Bearer s3cret-key"
    assert calls == [(expected, expected), (b"Bearer guess", expected), (b"", expected)]


async def test_every_key_of_a_keys_file_is_compared_whichever_matches(monkeypatch, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenant key\nalpha key-alpha-1\nbeta key-beta-22\n\nalpha key-alpha-3\n")
    keys.chmod(0o600)
    real = server.auth.secrets.compare_digest
    calls = []

    def spy(given, expected):
        calls.append(expected)
        return real(given, expected)

    monkeypatch.setattr(server.auth.secrets, "compare_digest", spy)
    async with in_process(api_keys=keys) as http:
        for key in ("key-alpha-1", "key-beta-22", "key-alpha-3", "nope"):
            response = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert (response.status_code == 401) == (key == "nope")  # past the key: 503, no model loaded here
    assert calls == [b"Bearer key-alpha-1", b"Bearer key-beta-22", b"Bearer key-alpha-3"] * 4


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "holds no key"),
        ("alpha\n", "line 1: expected 'TENANT KEY'"),
        ("bad/name key-12345\n", "line 1: a tenant name"),
        ("alpha short\n", "line 1: a key has 8+"),
        ("alpha key-12345\nbeta key-12345\n", "the same API key is given twice"),
    ],
)
def test_a_keys_file_that_cannot_be_used_is_refused_with_its_line(tmp_path, text, message):
    keys = tmp_path / "keys"
    keys.write_text(text)
    keys.chmod(0o600)
    with pytest.raises(server.auth.CredentialsError, match=re.escape(message)):
        server.auth.Credentials.load(api_keys_file=keys)


def test_a_short_api_key_is_refused():
    with pytest.raises(server.auth.CredentialsError, match="8\\+ printable"):
        create_app(Settings(model="unused", api_key="short"))


def test_api_key_on_the_command_line_is_warned_about(capsys):
    from server.cli import main

    assert main(["serve", "--model", "/nonexistent", "--api-key", "short"]) == 2
    err = capsys.readouterr().err
    assert "shows in the process list" in err and "--api-key: a key has 8+" in err


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_keys_file_others_can_read_or_write_is_refused(tmp_path, mode):
    keys = tmp_path / "keys"
    keys.write_text("alpha key-alpha-1\n")
    keys.chmod(mode)
    with pytest.raises(server.auth.CredentialsError, match="chmod 600"):
        server.auth.Credentials.load(api_keys_file=keys)


async def test_the_keys_file_is_reloaded_when_it_changes(tmp_path, monkeypatch):
    """A key added works and a key removed stops working, without a restart; a broken edit keeps
    the keys in force."""
    monkeypatch.setattr(server.auth, "RECHECK_SECONDS", 0.0)
    keys = tmp_path / "keys"
    keys.write_text("alpha key-alpha-1\n")
    keys.chmod(0o600)

    def rewrite(text: str) -> None:
        replacement = tmp_path / "keys.new"
        replacement.write_text(text)
        replacement.chmod(0o600)
        os.replace(replacement, keys)  # a new inode: seen whatever the mtime granularity

    def auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async with in_process(api_keys=keys) as http:
        assert (await http.get("/v1/models", headers=auth("key-alpha-1"))).status_code == 503  # past the key
        rewrite("beta key-beta-22\n")
        assert (await http.get("/v1/models", headers=auth("key-alpha-1"))).status_code == 401
        assert (await http.get("/v1/models", headers=auth("key-beta-22"))).status_code == 503
        rewrite("beta short\n")  # unusable: logged, the keys in force stay
        assert (await http.get("/v1/models", headers=auth("key-beta-22"))).status_code == 503


async def test_ready_names_the_model_only_to_a_key_holder():
    """The model id may be a local path; /ready is open to probes, so it tells them only 'ready'."""
    app = create_app(Settings(model="/srv/models/private-model", api_key="k" * 8))
    state = app.state.specd
    state.serving = type("Serving", (), {"model_id": "/srv/models/private-model"})()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
        anonymous = await http.get("/ready")
        assert anonymous.status_code == 200 and anonymous.json() == {"status": "ready"}
        wrong = await http.get("/ready", headers={"Authorization": "Bearer wrong-key"})
        assert "model" not in wrong.json()
        holder = await http.get("/ready", headers={"Authorization": "Bearer " + "k" * 8})
        assert holder.json() == {"status": "ready", "model": "/srv/models/private-model"}


async def test_only_the_named_tenants_read_server_wide_load(tmp_path):
    """--metrics-tenants: /metrics and /v1/speculation count every tenant's requests together;
    a tenant not named to watch them gets 403, while its own API calls go on."""
    keys = tmp_path / "keys"
    keys.write_text("ops key-ops-0001\nalpha key-alpha-1\n")
    keys.chmod(0o600)
    async with in_process(api_keys=keys, metrics_tenants=["ops"]) as http:
        for path in ("/metrics", "/v1/speculation"):
            reply = await http.get(path, headers={"Authorization": "Bearer key-alpha-1"})
            assert reply.status_code == 403 and reply.json()["error"]["type"] == "permission_error", path
        ops = await http.get("/metrics", headers={"Authorization": "Bearer key-ops-0001"})
        assert ops.status_code == 200
        assert (await http.get("/v1/speculation", headers={"Authorization": "Bearer key-ops-0001"})).status_code == 503
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer key-alpha-1"})).status_code == 503


def test_a_reload_rereads_the_keys_file_even_where_its_stamp_did_not_change(tmp_path, monkeypatch):
    """An edit in place within the same mtime tick and size leaves (mtime, size, inode) as it was:
    polling misses it, SIGHUP's reload does not."""
    monkeypatch.setattr(server.auth, "RECHECK_SECONDS", 0.0)
    keys = tmp_path / "keys"
    keys.write_text("alpha key-alpha-1\n")
    keys.chmod(0o600)
    ring = server.auth.KeyRing(api_keys_file=keys)
    before = os.stat(keys)
    keys.write_text("alpha key-alpha-2\n")  # same size, same inode
    os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert ring.current().tenant_for(b"Bearer key-alpha-1") == "alpha"  # the poll sees no change
    ring.reload()
    assert ring.current().tenant_for(b"Bearer key-alpha-1") is None
    assert ring.current().tenant_for(b"Bearer key-alpha-2") == "alpha"


async def test_sighup_runs_the_reload_on_the_event_loop():
    calls = []
    assert _on_sighup(lambda: calls.append(asyncio.get_running_loop()))
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            if calls:
                break
            await asyncio.sleep(0.01)
        assert calls == [asyncio.get_running_loop()]
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
