"""The job-session endpoints of ``icebarrier serve`` (:mod:`icebarrier.apps.catalog.sessions`)
as a client uses them: open (a long poll), hold, publish and release, each one logical request
under one idempotency key, sent again where its answer was lost; OAuth2 client credentials, the
access token renewed before it expires. ``icebarrier job exec`` (:mod:`.job_exec`) runs on it."""

from __future__ import annotations

import http.client
import json
import math
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

import uuid6

from icebarrier.apps.catalog.clients import tls_context
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.job_sessions import MAX_HEARTBEAT_S

# a long poll (up to MAX_WAIT_S) hears a line every `serve --heartbeat` (at most MAX_HEARTBEAT_S)
REQUEST_TIMEOUT_S = MAX_HEARTBEAT_S + 15.0
# a long poll ends this long before its access token expires (it plans again until its end)
TOKEN_SPARE_S = 15.0
RETRY_S = (0.1, 0.3, 1.0, 2.0, 4.0)  # one request whose answer was lost: sent again (same key) after these


class CatalogRequestError(IcebarrierError):
    """The catalog refused a session request (its one-line message) or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)

    @property
    def transient(self) -> bool:
        """No answer, one a restarting server gives, or the server's limit on requests in flight
        (429: many runs starting at once from one address): asking again may succeed."""
        return self.status is None or self.status in (429, 502, 503, 504)

    @property
    def retriable(self) -> bool:
        """A conflict (409: a sink moved under the run, the session taken over): the server
        planned the barrier again, and running it again may succeed."""
        return self.status == 409


class SessionClient:
    """The job-session endpoints of ``icebarrier serve``, with OAuth2 client credentials."""

    def __init__(self, uri: str, credential: str, ca_cert: str | None = None) -> None:
        client_id, colon, secret = credential.partition(":")
        if not colon or not client_id or not secret:
            raise IcebarrierError(
                "the catalog credential must be CLIENT_ID:SECRET (from `icebarrier token create "
                "--job JOB`); pass --credential or set ICEBARRIER_CATALOG_CREDENTIAL"
            )
        self.uri, self.client_id, self.secret = uri.rstrip("/"), client_id, secret
        self.tls = tls_context(ca_cert)
        self._token: str | None = None
        self._token_until = math.inf  # when the access token expires (monotonic), as the server said

    def _send(
        self, method: str, path: str, data: bytes | None, headers: dict, on_line: Callable[[dict], None] | None = None
    ) -> dict:
        """The answer; a stream of JSON lines (a long poll) goes line by line to ``on_line``, its
        last line is the answer (an ``error`` line is raised as the catalog's refusal)."""
        request = urllib.request.Request(self.uri + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S, context=self.tls) as response:
                if response.headers.get_content_type() != "application/x-ndjson":
                    return json.loads(response.read() or b"{}")
                for line in response:
                    item = json.loads(line)
                    if "error" in item:
                        raise CatalogRequestError(
                            f"the catalog at {self.uri} refused {method} {path}: {item['error'].get('message')}",
                            item["error"].get("code"),
                        )
                    if "ready" in item:
                        return item
                    if on_line is not None:
                        on_line(item)
                raise http.client.IncompleteRead(b"")
        except (http.client.IncompleteRead, ValueError) as exc:  # the server went away mid-answer
            raise CatalogRequestError(
                f"the catalog at {self.uri} cut its answer to {method} {path} short ({type(exc).__name__})"
            ) from None
        except urllib.error.HTTPError as exc:
            body = exc.read()
            try:
                parsed = json.loads(body)
                message = (
                    parsed["error"]["message"]
                    if "error" in parsed and isinstance(parsed["error"], dict)
                    else parsed.get("error_description") or parsed.get("error")
                )
            except (ValueError, KeyError, TypeError, AttributeError):
                message = body[:300].decode(errors="replace")
            raise CatalogRequestError(
                f"the catalog at {self.uri} refused {method} {path}: {message}", exc.code
            ) from None
        except OSError as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ssl.SSLCertVerificationError):  # not retried: it will not change
                raise IcebarrierError(
                    f"the catalog at {self.uri} presented a certificate this client does not trust "
                    f"({reason.verify_message}, CERTIFICATE_VERIFY_FAILED); pass --ca-cert with the CA that "
                    f"issued it (or set ICEBARRIER_CA_CERT)"
                ) from None
            raise CatalogRequestError(
                f"no catalog answers at {self.uri} ({reason}); start one with `icebarrier serve` or pass --catalog-uri"
            ) from None

    def token(self, lasts_s: float = 0.0) -> str:
        """An access token live for ``lasts_s`` more (and :data:`TOKEN_SPARE_S`): the one held, or a
        new one."""
        if self._token is None or time.monotonic() + lasts_s + TOKEN_SPARE_S > self._token_until:
            form = urllib.parse.urlencode(
                {"grant_type": "client_credentials", "client_id": self.client_id, "client_secret": self.secret}
            ).encode()
            asked = time.monotonic()
            answer = self._send("POST", "/v1/oauth/tokens", form, {"Content-Type": "application/x-www-form-urlencoded"})
            self._token, self._token_until = answer["access_token"], asked + answer.get("expires_in", math.inf)
        return self._token

    def call(
        self,
        method: str,
        job: str,
        path: str = "",
        body: dict | None = None,
        on_line: Callable[[dict], None] | None = None,
    ) -> dict:
        """One logical request under one idempotency key: a request whose answer was lost (no
        answer, an answer cut short, a server restarting) is sent again with the same key, and
        the server answers it with the first outcome instead of acting twice."""
        route = f"/icebarrier/v1/jobs/{urllib.parse.quote(job, safe='')}/session{path}"
        data = json.dumps(body).encode() if body is not None else None
        key = str(uuid6.uuid7())
        lost = 0
        authenticated = False
        while True:
            try:  # the token too: a token request refused for a while (429) or unanswered is sent again
                headers = {
                    "Authorization": f"Bearer {self.token()}",
                    "Content-Type": "application/json",
                    "Idempotency-Key": key,
                }
                return self._send(method, route, data, headers, on_line)
            except CatalogRequestError as exc:
                if exc.status == 401 and not authenticated:
                    self._token, authenticated = None, True  # the access token expired: authenticate again
                    continue
                if not exc.transient or lost >= len(RETRY_S):
                    raise
                time.sleep(RETRY_S[lost])
                lost += 1

    def open(
        self,
        job: str,
        *,
        skip: bool,
        coalesce: bool,
        hold_s: float,
        wait_s: float = 0.0,
        on_line: Callable[[dict], None] | None = None,
    ) -> dict:
        """Open the job's session; ``wait_s``: a long poll, whose progress (barriers the server
        skipped for the job) goes to ``on_line`` as it happens. Each plan the poll makes checks
        its token again, so it goes with one that outlives it (a new one if the one held would
        not), and ends sooner where the server's tokens live less long (`serve --token-ttl`)."""
        if wait_s > 0:
            self.token(wait_s)
            wait_s = max(0.0, min(wait_s, self._token_until - time.monotonic() - TOKEN_SPARE_S))
        return self.call(
            "POST", job, body={"skip": skip, "coalesce": coalesce, "hold_s": hold_s, "wait_s": wait_s}, on_line=on_line
        )

    def hold(self, job: str, run_id: str, hold_s: float) -> dict:
        return self.call("PUT", job, "/hold", {"run_id": run_id, "hold_s": hold_s})

    def publish(self, job: str, run_id: str) -> dict:
        return self.call("POST", job, "/publish", {"run_id": run_id})["completion"]

    def release(self, job: str, run_id: str) -> bool:
        return self.call("POST", job, "/release", {"run_id": run_id})["released"]
