"""Security: the API key guards every /v1 route (401 OpenAI error object for a
missing, wrong or wrongly-schemed key) and is compared only by
`secrets.compare_digest`; /health and /ready stay open, /metrics too unless
--metrics-auth; `model` is matched against served names and never opened or
loaded; the default bind is 127.0.0.1; CORS is off unless --allowed-origins;
every documented limit is enforced exactly at its boundary."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from scheduler.types import MAX_LOGIT_BIAS, MAX_SPEC_TOKENS, MAX_TOP_LOGPROBS
from server.app import create_app
from server.config import DEFAULT_MAX_MODEL_LEN, Settings
from server.protocol import MAX_CHOICES, MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from server.routes import router
from tests.reliability.rel_harness import API_KEY, CYCLE_NAME, INPUT_MAX_BODY_BYTES, INPUT_MAX_MODEL_LEN, INPUT_MODEL
from tests.support import REPO
from tests.support.server import in_process

DOC = REPO / "docs" / "reliability.md"

BAD_AUTH = {
    "missing": {},
    "wrong key": {"Authorization": "Bearer not-the-key"},
    "bare scheme": {"Authorization": "Bearer"},
    "key without scheme": {"Authorization": API_KEY},
    "basic scheme": {"Authorization": "Basic " + base64.b64encode(f"user:{API_KEY}".encode()).decode()},
    "token scheme": {"Authorization": f"Token {API_KEY}"},
    "key as prefix": {"Authorization": f"Bearer {API_KEY}x"},
    "key truncated": {"Authorization": f"Bearer {API_KEY[:-1]}"},
    "other header": {"X-API-Key": API_KEY},
}


def v1_routes() -> list[tuple[str, str]]:
    """(method, concrete path) of every /v1 route: the router's and the published schema's."""
    declared = {(method, route.path) for route in router.routes for method in route.methods - {"HEAD"}}
    schema = create_app(Settings(model="unused")).openapi()["paths"]
    declared |= {(method.upper(), path) for path, methods in schema.items() for method in methods}
    routes = sorted(
        {(method, re.sub(r"\{[^}]+\}", CYCLE_NAME, path)) for method, path in declared if path.startswith("/v1")}
    )
    assert len(routes) >= 5, routes
    return routes + [("GET", "/v1/no-such-route"), ("POST", "/v1/completions?api_key=" + API_KEY)]


def assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, (response.request.url, response.text[:300])
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key" and error["param"] is None
    assert API_KEY not in error["message"]


@pytest.mark.parametrize("auth", list(BAD_AUTH), ids=list(BAD_AUTH))
def test_every_v1_route_refuses_a_bad_key(chaos_server, tally, auth):
    for method, path in v1_routes():
        tally.cases_tried += 1
        assert_401(httpx.request(method, chaos_server.url + path, headers=BAD_AUTH[auth], json={}, timeout=30))


def test_the_right_key_opens_every_route_and_health_stays_open(chaos_server):
    good = {"Authorization": f"Bearer {API_KEY}"}
    expected = {"GET": 200, "POST": 400}  # POST {} is an invalid request, but an authenticated one
    for method, path in v1_routes()[:-2]:
        response = httpx.request(method, chaos_server.url + path, headers=good, json={}, timeout=30)
        assert response.status_code == expected[method], (method, path, response.text[:300])
    for path in ("/health", "/ready"):
        assert httpx.get(chaos_server.url + path, timeout=30).status_code == 200
    assert httpx.get(chaos_server.url + "/metrics", headers=good, timeout=30).status_code == 200


async def test_a_keyless_loopback_server_answers_only_loopback_host_names():
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 sends its own name in Host."""
    async with in_process() as http:
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.nip.io", "10.0.0.1"):
            reply = await http.get("/health", headers={"Host": host})
            assert reply.status_code == 421, host
            assert reply.json()["error"]["code"] == "misdirected_request"
        for host in ("localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000"):
            assert (await http.get("/health", headers={"Host": host})).status_code == 200, host
    async with in_process(trusted_hosts=["specd.internal"]) as http:
        assert (await http.get("/health", headers={"Host": "specd.internal:8000"})).status_code == 200
    async with in_process(api_key="k" * 12) as http:  # a key: the key is the guard, any name is served
        assert (await http.get("/health", headers={"Host": "specd.example.com"})).status_code == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
async def test_a_keyless_server_checks_host_names_whatever_it_binds(host):
    """A container binds 0.0.0.0 keyless while compose publishes the port on 127.0.0.1: a page
    rebound to 127.0.0.1 reaches it exactly as it would a loopback bind."""
    async with in_process(host=host, allow_unauthenticated=True) as http:
        for path in ("/metrics", "/v1/models", "/v1/speculation"):
            reply = await http.get(path, headers={"Host": "evil.example:8000"})
            assert reply.status_code == 421, (host, path)
            assert reply.json()["error"]["code"] == "misdirected_request"
        assert (await http.get("/metrics", headers={"Host": "localhost:8000"})).status_code == 200
    async with in_process(host=host, allow_unauthenticated=True, trusted_hosts=["specd"]) as http:
        assert (await http.get("/metrics", headers={"Host": "specd:8000"})).status_code == 200
        assert (await http.get("/metrics", headers={"Host": "evil.example"})).status_code == 421
    async with in_process(host=host, allow_unauthenticated=True, trusted_hosts=["*"]) as http:  # opted out
        assert (await http.get("/metrics", headers={"Host": "evil.example"})).status_code == 200


# -- the model field ---------------------------------------------------------------------

HOSTILE_NAMES = [
    "../../etc/passwd",
    "/etc/passwd",
    "file:///etc/passwd",
    "..\\..\\windows\\win.ini",
    "~/.ssh/id_rsa",
    "%2e%2e%2fetc%2fpasswd",
    "tiny/../tiny",
    "./tiny",
    "TINY",
    "tiny\u0000",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gpt2",
]


def test_hostile_model_names_are_404_on_the_running_server(chaos_server):
    for name in HOSTILE_NAMES:
        for path in ("/completions", "/chat/completions"):
            body = {"model": name, "prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
            response = httpx.post(chaos_server.base_url + path, json=body, headers=chaos_server.headers, timeout=30)
            assert response.status_code == 404, (name, response.text)
            error = response.json()["error"]
            assert error["param"] == "model" and error["code"] == "model_not_found"
    models = httpx.get(chaos_server.base_url + "/models", headers=chaos_server.headers, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [CYCLE_NAME]


_AUDIT: list | None = None  # events recorded while a test watches
_AUDIT_HOOKED = False  # audit hooks cannot be removed: install one per process


def _audit_hook(event: str, args: tuple) -> None:
    if _AUDIT is not None and event.split(".")[0] in ("open", "os", "socket", "subprocess", "shutil", "glob"):
        _AUDIT.append((event, repr(args)[:300]))


async def test_model_names_are_never_opened_or_loaded(tiny_llama_dir, monkeypatch):
    """In-process engine on the tiny model: no file, directory or socket is touched because of a
    `model` value, and no loader runs (an audit hook sees every open, listdir and connect)."""
    global _AUDIT, _AUDIT_HOOKED
    import transformers

    import models.loader

    settings = Settings(
        model=str(tiny_llama_dir), served_model_name="tiny", dtype="float32", device="cpu", max_num_seqs=2
    )
    app = create_app(settings)
    state = app.state.specd
    await state.start_engine()
    assert state.serving is not None, state.load_error

    def must_not_load(*args, **kwargs):
        raise AssertionError(f"a model load was attempted: {args!r}")

    monkeypatch.setattr(models.loader, "load_model", must_not_load)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer, transformers.AutoConfig):
        monkeypatch.setattr(auto, "from_pretrained", must_not_load)
    if not _AUDIT_HOOKED:
        sys.addaudithook(_audit_hook)
        _AUDIT_HOOKED = True
    names = HOSTILE_NAMES + [str(tiny_llama_dir), str(tiny_llama_dir) + "/config.json"]
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
            _AUDIT = []
            for name in names:
                reply = await http.post(
                    "/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "x"}]}
                )
                assert reply.status_code == 404 and reply.json()["error"]["param"] == "model", (name, reply.text)
                card = await http.get("/v1/models/" + quote(name, safe=""))  # no client-side ../ folding
                assert card.status_code == 404, (name, card.text)
            with open(os.devnull, "rb"):  # the hook is live: this open must be seen
                pass
            events, _AUDIT = _AUDIT, None
            ok = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
            assert ok.status_code == 200
    finally:
        _AUDIT = None
        await state.stop_engine()
    assert any(os.devnull in e[1] for e in events), events
    touched = [
        e
        for e in events
        if any(s in e[1] for s in ("passwd", "win.ini", "id_rsa", "SmolLM2", "gpt2", str(tiny_llama_dir)))
    ]
    assert touched == [], touched
    assert not [e for e in events if e[0].startswith("socket")], events


# -- bind address and CORS -----------------------------------------------------------------


def listening_addresses(port: int) -> list[str]:
    """Local addresses in LISTEN state on `port`, from /proc/net/tcp and tcp6 (hex, as the kernel writes them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":
                found.append(address)
    return found


def test_default_bind_is_loopback(chaos_server):
    assert Settings.model_fields["host"].default == "127.0.0.1"
    assert listening_addresses(chaos_server.port) == ["0100007F"]  # 127.0.0.1, and no IPv6 or wildcard socket


async def test_cors_is_off_unless_origins_are_allowed(chaos_server):
    preflight = {
        "Origin": "http://evil.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }
    response = httpx.options(chaos_server.base_url + "/chat/completions", headers=preflight, timeout=30)
    assert "access-control-allow-origin" not in response.headers and response.status_code >= 400
    response = httpx.get(
        chaos_server.base_url + "/models", headers={**chaos_server.headers, "Origin": "http://evil.example"}, timeout=30
    )
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    async with in_process(api_key="k" * 8, allowed_origins="http://ui.example") as http:
        allowed = await http.options("/v1/chat/completions", headers={**preflight, "Origin": "http://ui.example"})
        assert allowed.headers["access-control-allow-origin"] == "http://ui.example"
        refused = await http.options("/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in refused.headers


# -- limits: documented and enforced at the boundary -----------------------------------------

DOCUMENTED_LIMITS = {  # a word that names the limit in the docs table -> its value
    "--max-body-bytes": Settings.model_fields["max_body_bytes"].default,
    "--max-model-len": DEFAULT_MAX_MODEL_LEN,
    "--max-queue": Settings.model_fields["max_queue"].default,
    "--max-prep-queue": Settings.model_fields["max_prep_queue"].default,
    "--max-num-seqs": Settings.model_fields["max_num_seqs"].default,
    "`n`": MAX_N,
    "prompts × `n`": MAX_CHOICES,
    "`stop` strings": MAX_STOP_STRINGS,
    "`stop` string length": MAX_STOP_STRING_CHARS,
    "`logit_bias` entries": MAX_LOGIT_BIAS,
    "`logprobs` / `top_logprobs`": MAX_TOP_LOGPROBS,
    "`num_speculative_tokens`": MAX_SPEC_TOKENS,
}


def test_limits_are_documented_with_their_values():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("|")]
    for name, value in DOCUMENTED_LIMITS.items():
        matching = [row for row in rows if name in row]
        assert matching, f"{name} is missing from the limits table of {DOC.name}"
        assert any(re.search(rf"(?<![\d,]){value:,}(?![\d,])|(?<!\d){value}(?!\d)", row) for row in matching), (
            name,
            value,
            matching,
        )


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PAD = "pad"


def bias_of(num_entries: int) -> dict[str, float]:
    return {str(token_id): 0.5 for token_id in range(num_entries)}


def sized_body(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (an unknown field carries the padding)."""
    body = {"model": INPUT_MODEL, "prompt": "Hello", "max_tokens": 1, PAD: ""}
    filler = size - len(json.dumps(body).encode())
    body[PAD] = "x" * filler
    raw = json.dumps(body).encode()
    assert len(raw) == size
    return raw


PROMPTS_AT_LIMIT = MAX_CHOICES // MAX_N  # prompts that, with n = MAX_N, make MAX_CHOICES sequences
BOUNDARIES = [  # (limit, path, fields at the limit, fields one past it, param)
    ("n", CMPL, {"n": MAX_N}, {"n": MAX_N + 1}, "n"),
    (
        "prompts x n",
        CMPL,
        {"prompt": ["hi"] * PROMPTS_AT_LIMIT, "n": MAX_N},
        {"prompt": ["hi"] * (PROMPTS_AT_LIMIT + 1), "n": MAX_N},
        "n",
    ),
    ("stop strings", CHAT, {"stop": ["zq"] * MAX_STOP_STRINGS}, {"stop": ["zq"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    (
        "stop length",
        CHAT,
        {"stop": ["q" * MAX_STOP_STRING_CHARS]},
        {"stop": ["q" * (MAX_STOP_STRING_CHARS + 1)]},
        "stop",
    ),
    # The tiny vocabulary (320) cannot fill 1024 entries with valid ids: 256 pass, 1025 are refused by count.
    ("logit_bias", CMPL, {"logit_bias": bias_of(256)}, {"logit_bias": bias_of(MAX_LOGIT_BIAS + 1)}, "logit_bias"),
    ("logprobs", CMPL, {"logprobs": MAX_TOP_LOGPROBS}, {"logprobs": MAX_TOP_LOGPROBS + 1}, "logprobs"),
    (
        "top_logprobs",
        CHAT,
        {"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS},
        {"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS + 1},
        "top_logprobs",
    ),
    (
        "num_speculative_tokens",
        CMPL,
        {"num_speculative_tokens": MAX_SPEC_TOKENS},
        {"num_speculative_tokens": MAX_SPEC_TOKENS + 1},
        "num_speculative_tokens",
    ),
    (
        "prompt tokens",
        CMPL,
        {"prompt": [5] * (INPUT_MAX_MODEL_LEN - 1)},
        {"prompt": [5] * INPUT_MAX_MODEL_LEN},
        "prompt",
    ),
    (
        "max_tokens",
        CMPL,
        {"prompt": [5] * 10, "max_tokens": INPUT_MAX_MODEL_LEN - 10},
        {"prompt": [5] * 10, "max_tokens": INPUT_MAX_MODEL_LEN - 9},
        "max_tokens",
    ),
]


@pytest.mark.parametrize("limit, path, at, over, param", BOUNDARIES, ids=[b[0] for b in BOUNDARIES])
def test_limit_boundaries(input_server, tally, limit, path, at, over, param):
    base = {"model": INPUT_MODEL, "max_tokens": 1}
    base.update({"prompt": "Hello"} if path == CMPL else {"messages": [{"role": "user", "content": "Hello"}]})
    tally.cases_tried += 2
    accepted = httpx.post(input_server.url + path, json={**base, **at}, timeout=120)
    assert accepted.status_code == 200, accepted.text[:300]
    refused = httpx.post(input_server.url + path, json={**base, **over}, timeout=120)
    assert refused.status_code == 400, refused.text[:300]
    assert refused.json()["error"]["param"] == param
    if limit == "logit_bias":  # refused for its size, before any key is parsed
        assert f"at most {MAX_LOGIT_BIAS} entries" in refused.json()["error"]["message"]


def test_body_limit_boundary(input_server, tally):
    tally.cases_tried += 2
    headers = {"content-type": "application/json"}
    at = httpx.post(input_server.url + CMPL, content=sized_body(INPUT_MAX_BODY_BYTES), headers=headers, timeout=60)
    assert at.status_code == 200, at.text[:300]
    over = httpx.post(
        input_server.url + CMPL, content=sized_body(INPUT_MAX_BODY_BYTES + 1), headers=headers, timeout=60
    )
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"


# -- test-only switches stay off -----------------------------------------------------------


def test_fault_field_is_inert_without_the_hidden_flag(input_server):
    """The input server runs without --enable-fault-injection: `fault` is an ignored unknown field."""
    for fault in ("raise", "nan"):
        body = {"model": INPUT_MODEL, "prompt": "Hello", "max_tokens": 3, "fault": fault, "stream": fault == "nan"}
        response = httpx.post(input_server.url + CMPL, json=body, timeout=60)
        assert response.status_code == 200 and '"error"' not in response.text, response.text[:300]
    help_text = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--help"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert "--enable-fault-injection" not in help_text and "127.0.0.1" in help_text


async def test_the_product_app_has_no_debug_routes():
    async with in_process() as http:
        for path in ("/_probe", "/docs", "/redoc", "/debug", "/v1/debug"):
            assert (await http.get(path)).status_code == 404, path


def test_idle_connections_count_against_the_connection_limit(tiny_llama_dir, tmp_path):
    """--limit-concurrency: connections that send nothing cannot pile up without bound; past the
    limit a request gets 503 at once, and once they close the server answers again.
    --header-timeout: a client that trickles its headers, one line at a time, is cut off."""
    import socket
    import time

    from tests.support.server import SpecdServer, serve_args

    args = serve_args(
        model=tiny_llama_dir,
        dtype="float32",
        device="cpu",
        limit_concurrency=3,
        timeout_keep_alive=2,
        header_timeout=1.5,
    )
    server = SpecdServer(args, tmp_path / "limit.log")
    idle: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(server.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.process.poll() is None, server.log_tail()
                time.sleep(0.2)
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        time.sleep(0.3)
        assert httpx.get(server.url + "/health", timeout=5, trust_env=False).status_code == 503
        for sock in idle:
            sock.close()
        time.sleep(0.3)
        assert httpx.get(server.url + "/health", timeout=5, trust_env=False).status_code == 200
        slow = socket.create_connection(("127.0.0.1", server.port))
        idle = [slow]
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started, cut = time.monotonic(), None
        while time.monotonic() - started < 10 and cut is None:
            time.sleep(0.25)
            try:
                slow.sendall(b"X-Slow: 1\r\n")
                slow.settimeout(0.01)
                if slow.recv(1) == b"":
                    cut = time.monotonic() - started
            except TimeoutError:
                pass
            except OSError:
                cut = time.monotonic() - started
        assert cut is not None and 1.4 < cut < 4, cut
        # A connection that finishes its headers in time is served, then closed for idling.
        with httpx.Client(trust_env=False) as client:
            assert client.get(server.url + "/health", timeout=5).status_code == 200
            time.sleep(1.0)
            assert client.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        for sock in idle:
            sock.close()
        server.kill()
