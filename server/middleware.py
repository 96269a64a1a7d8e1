"""Pure ASGI middleware: body size limit, API keys and tenants, the keyless Host check, one log line per
generation request."""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.auth import DEFAULT_TENANT, KeyRing
from server.errors import error_response
from server.record import RECORD_SCOPE_KEY, RequestRecord

request_logger = logging.getLogger("specd.request")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
OBSERVER_PATHS = ("/metrics", "/v1/speculation")  # server-wide counts: every tenant's load together


# JSON values a body may hold beyond its prompts' token ids (`json_values_refusal`), and arrays and
# objects in all: far above any request that fits a context (1024 messages, 128 prompts), far below
# the ~1M that a 4 MiB body can hold.
MAX_OTHER_JSON_VALUES = 1 << 16
MAX_JSON_CONTAINERS = 1 << 15


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`, judged by Content-Length and by the bytes actually sent,
    or holding more than `max_values` JSON values (`json_values_refusal`).

    The body is read here and replayed to the app, so the app never sees a
    partial oversized body; later `receive` calls (disconnects) pass through.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, max_values: int | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.max_values = max_values

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        refusal = json_values_refusal(chunks, self.max_values) if self.max_values is not None else None
        if refusal is not None:
            await error_response(413, refusal, "invalid_request_error", code="request_too_large")(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            f"the request body exceeds {self.max_bytes} bytes",
            "invalid_request_error",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)


def json_values_refusal(chunks: list[bytes], max_values: int) -> str | None:
    """Why a body holds too many JSON values to parse, or None: judged from its bytes at C speed
    (milliseconds for 4 MiB), before the parser makes an object of each value and the validators
    walk them, which for ~2M values costs the event loop a second. Every element of an array or
    object after the first follows a comma, every container opens with a bracket; those in strings
    count too, so this bounds from above: no text that fits the context comes near either limit."""
    containers, most = sum(chunk.count(b"[") + chunk.count(b"{") for chunk in chunks), MAX_JSON_CONTAINERS
    if containers > most:
        return f"the request body holds {containers} JSON arrays and objects; at most {most} are accepted"
    values = 1 + sum(chunk.count(b",") for chunk in chunks)
    if values > max_values:
        return f"the request body holds {values} JSON values; at most {max_values} are accepted (prompts x tokens)"
    return None


TENANT_SCOPE_KEY = "specd.tenant"


def request_tenant(scope: Scope) -> str:
    """The tenant `AuthMiddleware` found for this request (the one tenant with no keys configured)."""
    return scope.get(TENANT_SCOPE_KEY, DEFAULT_TENANT)


class AuthMiddleware:
    """`Authorization: Bearer KEY` on /v1/* (and /metrics when asked); the key's tenant goes
    into the scope (`request_tenant`) for the endpoints to key the request's caches by."""

    def __init__(
        self, app: ASGIApp, keys: KeyRing, protect_metrics: bool, observer_tenants: frozenset[str] = frozenset()
    ):
        self.app = app
        self.keys = keys
        self.protect_metrics = protect_metrics
        self.observer_tenants = observer_tenants  # --metrics-tenants; empty: every tenant

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1/") or path == "/v1" or (self.protect_metrics and path == "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self._protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = (_header(scope, b"authorization") or "").encode("latin-1")
        tenant = self.keys.current().tenant_for(given)
        if tenant is None:
            message = "missing API key" if not given else "invalid API key"
            response = error_response(
                401,
                f"{message}: send 'Authorization: Bearer <key>'",
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        if self.observer_tenants and scope["path"] in OBSERVER_PATHS and tenant not in self.observer_tenants:
            # Server-wide load and acceptance: another tenant's activity, for the tenants named to watch it.
            response = error_response(
                403,
                "this key's tenant may not read server-wide metrics (see --metrics-tenants)",
                "permission_error",
                code="insufficient_permissions",
            )
            await response(scope, receive, send)
            return
        scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")
ANY_HOST = "*"


class HostCheckMiddleware:
    """With no API key, the server answers only requests addressed to a loopback name or to a
    name in --trusted-hosts, whatever address it binds.

    Otherwise any web page its user opens could rebind its own host name to the server's
    address and use the API from the browser (DNS rebinding): the browser would send that
    page's host name in `Host`. Binding 0.0.0.0 inside a container whose port is published on
    127.0.0.1 is the same exposure, so the bind address decides nothing. A 421 names the
    problem; nothing else is served.
    """

    def __init__(self, app: ASGIApp, trusted_hosts: tuple[str, ...] = ()):
        self.app = app
        self.allowed = {*LOOPBACK_NAMES, *(_host_name(h) for h in trusted_hosts)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _host_name(_header(scope, b"host") or "") in self.allowed:
            await self.app(scope, receive, send)
            return
        response = error_response(
            421,
            "without an API key this server answers only requests to localhost, 127.0.0.1, [::1] or a name in "
            "--trusted-hosts; serve with an API key, or name this host in --trusted-hosts",
            "invalid_request_error",
            code="misdirected_request",
        )
        await response(scope, receive, send)


def _host_name(host: str) -> str:
    """`Host` without its port: "localhost:8000" -> "localhost", "[::1]:8000" -> "[::1]"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class RequestLogMiddleware:
    """One structured line per completion request, after its last byte is sent.

    `id=... status=200 stream=true n=1 prompt_tokens=.. completion_tokens=..
    ttft_s=.. e2e_s=.. spec_accepted=.. spec_drafted=.. finish_reason=stop`
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        record = scope[RECORD_SCOPE_KEY] = RequestRecord(endpoint=scope["path"])
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            _log(record, record.status or status, time.monotonic())


def _log(record: RequestRecord, status: int, now: float) -> None:
    ttft = "-" if record.first_token is None else f"{record.first_token - record.arrival:.4f}"
    request_logger.info(
        "id=%s endpoint=%s status=%d stream=%s n=%d prompt_tokens=%d completion_tokens=%d "
        "ttft_s=%s e2e_s=%.4f spec_accepted=%d spec_drafted=%d finish_reason=%s",
        record.request_id,
        record.endpoint,
        status,
        str(record.stream).lower(),
        record.n,
        record.prompt_tokens,
        record.completion_tokens,
        ttft,
        now - record.arrival,
        record.spec_accepted,
        record.spec_drafted,
        ",".join(record.finish_reasons) or "-",
    )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
