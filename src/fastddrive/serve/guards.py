"""The service's doors (issue 32): an API key on every route but the probes (/healthz, /readyz), and bodies
bounded in size and time.

Both are plain ASGI middleware, so they run before FastAPI reads anything. `BearerKey` answers 401 (with
`WWW-Authenticate`) to a request without `Authorization: Bearer <key>`, comparing in constant time.
`BodyLimit` answers 413 when `Content-Length` is past the limit, before reading a byte, and counts the bytes
of a body sent without one (chunked) while they arrive, refusing it once past the limit; a body that has not
arrived within the limit's time is a 408, and the connection is then closed.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import socket
import time

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastddrive.serve.limits import ServiceLimits

# A load balancer's (or Kubernetes') liveness and readiness probes carry no key; neither route says more than
# whether the service is up and ready.
OPEN_PATHS = ("/healthz", "/readyz")


class BearerKey:
    """401 unless the request carries `Authorization: Bearer <key>`; the probes (OPEN_PATHS) are open."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        if given:
            detail, challenge = "the API key is wrong", 'Bearer error="invalid_token"'
        else:
            detail, challenge = "this service needs an API key: send Authorization: Bearer <key>", "Bearer"
        refusal = JSONResponse({"detail": detail}, 401, headers={"WWW-Authenticate": challenge})
        await refusal(scope, receive, send)


class BodyLimit:
    """413 for a body past `limits.max_body_bytes` (declared, or counted as it arrives), 408 for one that has not
    arrived within `limits.body_timeout_s` of the request's start."""

    def __init__(self, app: ASGIApp, limits: ServiceLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, timeout_s = self.limits.max_body_bytes, self.limits.body_timeout_s
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            # uvicorn reads the rest of the body and drops it; closing now could lose this answer to a reset.
            await JSONResponse({"detail": too_large(limit)}, 413)(scope, receive, send)
            return
        deadline = time.monotonic() + timeout_s
        received, more = 0, True

        async def bounded() -> Message:
            nonlocal received, more
            if not more:  # the body is in; what follows is a disconnect, however late
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                raise HTTPException(
                    408, f"the request body did not arrive within {timeout_s:g} s", headers={"Connection": "close"}
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                more = message.get("more_body", False)
                if received > limit:
                    raise HTTPException(413, too_large(limit))
            return message

        await self.app(scope, bounded, send)


def too_large(limit: int) -> str:
    return f"the request body is larger than the {limit} bytes this service takes"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name to bind) reaches only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ListenError(ValueError):
    """An address the service cannot listen on: in use, not this machine's, or a port that needs privileges."""


def listening_socket(host: str, port: int) -> socket.socket:
    """The service's socket, bound before the model loads, so that a port in use is one line at once rather
    than a traceback after the load; handed to uvicorn, so that nothing can take the port in between."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as err:
        raise ListenError(f"--host {host}: not an address of this machine ({err.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ListenError(
                f"--port {port}: {host}:{port} is in use (another server?); choose another port"
            ) from None
        if err.errno == errno.EACCES:
            raise ListenError(f"--port {port}: listening there needs privileges; choose a port from 1024") from None
        raise ListenError(f"--host {host} --port {port}: cannot listen there ({err.strerror})") from None
    return sock


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """One line to print at start when the service listens beyond this machine without a key."""
    if api_key or is_loopback(host):
        return None
    return (
        f"warning: serving on {host} without an API key: anyone who can reach this address can use the model;"
        " give --api-key (or FASTDDRIVE_API_KEY), or listen on 127.0.0.1"
    )
