"""A serving engine's URL as a user gives it (`vllm:URL`, `kvtui load URL`), checked once, where it
enters: without kvtui.engines.vllm.client's HTTP (http.client, ssl), which the check before the
app opens, and the app's first frame, do not wait for."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from kvtui.errors import EngineError
from kvtui.format import safe_text


@dataclass(frozen=True)
class ServerURL:
    """A server's base URL, checked: http or https, a host (a valid IDNA name, kept in its ASCII
    form), a port (the scheme's by default), an optional path prefix (a proxy's, percent-encoded
    as sent), no credentials, query or fragment."""

    scheme: str
    host: str
    port: int
    prefix: str = ""
    """A path before the API's own (`/v1/...`), without its trailing slash."""

    @classmethod
    def parse(cls, text: str, what: str = "the server URL") -> ServerURL:
        """The URL `text`, or `EngineError` with one line saying what is wrong with it. A
        trailing `/v1` (the OpenAI client's base URL) is taken off."""
        shown = safe_text(repr(text) if len(text) <= 60 else repr(text[:57] + "..."))
        if any(ord(c) < 33 or ord(c) == 127 for c in text):
            raise EngineError(f"{what} {shown} holds spaces or control characters")
        try:
            parts = urlsplit(text)
            port = parts.port
        except ValueError as exc:
            raise EngineError(f"{what} {shown} is not a URL: {exc}") from None
        if parts.scheme not in ("http", "https"):
            raise EngineError(
                f"{what} {shown} must start with http:// or https://, e.g. http://127.0.0.1:8000"
            )
        if parts.username is not None or parts.password is not None:
            raise EngineError(f"{what} {shown} holds credentials; kvtui sends none")
        if not parts.hostname:
            raise EngineError(f"{what} {shown} has no host, e.g. http://127.0.0.1:8000")
        if parts.query or parts.fragment or text.endswith(("?", "#")):
            raise EngineError(f"{what} {shown} has a query or fragment; give the server's base URL")
        if port == 0:
            raise EngineError(f"{what} {shown}: port 0 is not a port")
        host = _host(parts.hostname, f"{what} {shown}")
        try:  # bytes that were not UTF-8 (surrogate escapes, from argv) go as they came
            raw = parts.path.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raise EngineError(f"{what} {shown} has a path that is not text") from None
        prefix = quote(raw, safe="/%:@!$&'()*+,;=-._~").rstrip("/").removesuffix("/v1")
        default = 443 if parts.scheme == "https" else 80
        return cls(parts.scheme, host, port or default, prefix)

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.netloc}{self.prefix}"


def _host(hostname: str, shown: str) -> str:
    """The host as it is sent: an IP address as given, a name in its ASCII (IDNA) form;
    `EngineError` for a name no DNS holds (an empty label, a label past 63 characters)."""
    if ":" in hostname:  # an IPv6 address (urlsplit took its brackets off)
        return hostname
    try:
        return hostname.encode("idna").decode("ascii")
    except UnicodeError:
        raise EngineError(f"{shown} has a host that is not a valid host name") from None
