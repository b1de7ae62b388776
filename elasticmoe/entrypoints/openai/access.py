"""Who may call what, and how big a request may be: API keys and size limits (ASGI middleware).

- `/v1/*` needs `Authorization: Bearer <api key>` when an API key is set.
- `/admin/*` needs the admin key when one is set, else the API key when that is set
  (an API-key holder is never an administrator by accident: set both).
- The API's own description (`/openapi.json`, `/docs`, `/redoc`) needs the admin key too: it
  maps every route and bound, which a server with keys does not hand to strangers.
- `/health`, `/ready` and `/metrics` stay open (probes and scrapers carry no keys).
- Headers larger than `max_header_bytes` get 431, bodies larger than `max_body_bytes` 413
  (by Content-Length up front, else counted while the body streams in).

Keys are compared in constant time and never logged; 401s name no key.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20  # prompts of ~1M characters; raise it for long-context models
DEFAULT_MAX_HEADER_BYTES = 16 << 10
API_DOCS = frozenset({"/openapi.json", "/docs", "/redoc"})


@dataclasses.dataclass(frozen=True, slots=True)
class AccessPolicy:
    api_key: str | None = dataclasses.field(default=None, repr=False)
    admin_key: str | None = dataclasses.field(default=None, repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES

    def __post_init__(self) -> None:
        for option, key in (("--api-key", self.api_key), ("--admin-key", self.admin_key)):
            if key is not None and (len(key) < 8 or key != key.strip()):
                raise ValueError(f"{option}: must be at least 8 characters without surrounding spaces")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes: must be >= 1024, got {self.max_body_bytes}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"--max-header-bytes: must be >= 1024, got {self.max_header_bytes}")

    def required_key(self, path: str) -> str | None:
        """The key `path` needs, or None if it is open."""
        if path.startswith("/admin") or path in API_DOCS or path.startswith("/docs/"):
            return self.admin_key or self.api_key
        if path.startswith("/v1"):
            return self.api_key
        return None


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


async def _reply(
    send: Send, status: int, message: str, type_: str, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class AccessMiddleware:
    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = self.policy
        headers = scope.get("headers", ())
        if sum(len(k) + len(v) + 4 for k, v in headers) > policy.max_header_bytes:
            await _reply(send, 431, f"Request headers exceed {policy.max_header_bytes} bytes.",
                         "RequestHeaderFieldsTooLargeError")
            return
        needed = policy.required_key(scope.get("path", ""))
        if needed is not None:
            given = _bearer(scope)
            if given is None or not hmac.compare_digest(given.encode(), needed.encode()):
                what = "admin key" if needed == policy.admin_key else "API key"
                await _reply(send, 401, f"Missing or invalid {what}: send 'Authorization: Bearer <key>'.",
                             "AuthenticationError", ((b"www-authenticate", b"Bearer"),))
                return
        length = next((v for k, v in headers if k == b"content-length"), None)
        if length is not None:
            if length.isdigit() and int(length) > policy.max_body_bytes:
                await _reply(send, 413, f"Request body exceeds {policy.max_body_bytes} bytes.", "RequestTooLargeError")
                return
            await self.app(scope, receive, send)  # the server enforces the declared length
            return
        await self._call_buffering_body(scope, receive, send)

    async def _call_buffering_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A body without Content-Length (chunked): read it up to the limit, then replay it."""
        limit, size = self.policy.max_body_bytes, 0
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _reply(send, 413, f"Request body exceeds {limit} bytes.", "RequestTooLargeError")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: disconnect notifications

        await self.app(scope, replay, send)
