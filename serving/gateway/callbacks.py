"""Job callbacks that cannot be turned against the gateway's network: `check_url` (parsed once, rebuilt, host and port
allow-listed, no userinfo or backslashes), `resolve` (resolved once; loopback, private and link-local addresses refused
unless listed), `sign` (Standard Webhooks: webhook-id, webhook-timestamp, webhook-signature) and `Deliverer` (its own
bounded aiohttp client: connects only to the checked addresses, follows no redirect, a total deadline per attempt).
Details: docs/security.md."""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import hmac
import ipaddress
import logging
import socket
import urllib.parse

import aiohttp
from aiohttp.abc import AbstractResolver

from serving.gateway.config import CallbackConfig

log = logging.getLogger(__name__)

MAX_URL_CHARS = 2048
_PCHARS = "/%:@!$&'()*+,;=-._~"  # RFC 3986 path characters kept as they are when the URL is rebuilt
_DEFAULT_PORTS = {"http": 80, "https": 443}


class CallbackRefused(ValueError):
    """A callback URL or address the policy refuses; the message names what and why (shown to the submitter only
    for the URL itself, never for what a delivery found)."""


def check_url(url: str, cfg: CallbackConfig) -> str:
    """The URL rebuilt from its parsed parts (scheme, host, port, path, query; no userinfo, no fragment), or
    CallbackRefused. What is checked is what will be fetched: the rebuilt URL is stored and used."""
    if len(url) > MAX_URL_CHARS:
        raise CallbackRefused(f"callback_url: {len(url)} characters; at most {MAX_URL_CHARS}")
    if "\\" in url:
        raise CallbackRefused("callback_url: backslashes are not allowed (parsers disagree on them)")
    if not url.isascii() or any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise CallbackRefused("callback_url: only printable ASCII without spaces is allowed")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in _DEFAULT_PORTS or not parts.netloc:
        raise CallbackRefused(f"callback_url: {url!r} is not an http(s) URL")
    if "@" in parts.netloc:
        raise CallbackRefused("callback_url: user information (user@host) is not allowed")
    host = (parts.hostname or "").lower()
    try:
        port = parts.port or _DEFAULT_PORTS[parts.scheme]
    except ValueError:
        raise CallbackRefused(f"callback_url: the port of {parts.netloc!r} is not a number in 1-65535") from None
    try:
        host = str(ipaddress.ip_address(host))
        literal = True
    except ValueError:
        literal = False
    if not host or host not in cfg.allowed_hosts:
        raise CallbackRefused(f"callback_url: host {host!r} is not on the gateway's callback allow-list "
                              f"({', '.join(cfg.allowed_hosts) or 'empty'})")
    if port not in cfg.allowed_ports:
        raise CallbackRefused(f"callback_url: port {port} is not on the gateway's callback allow-list "
                              f"({', '.join(map(str, cfg.allowed_ports)) or 'empty'})")
    netloc = f"[{host}]" if literal and ":" in host else host
    if parts.port is not None:
        netloc += f":{port}"
    path = urllib.parse.quote(parts.path or "/", safe=_PCHARS)
    query = urllib.parse.quote(parts.query, safe=_PCHARS + "?")
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, query, ""))


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def address_allowed(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, cfg: CallbackConfig) -> bool:
    if isinstance(addr, ipaddress.IPv6Address):  # an IPv4 address inside one (mapped, 6to4, NAT64) is that address
        embedded = addr.ipv4_mapped or addr.sixtofour or (
            ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF) if addr in _NAT64 else None)
        if embedded is not None:
            addr = embedded
    if any(addr in ipaddress.ip_network(n, strict=False) for n in cfg.allowed_networks):
        return True
    return addr.is_global and not addr.is_multicast


async def resolve(host: str, port: int, cfg: CallbackConfig, executor: concurrent.futures.Executor) -> list[str]:
    """The addresses `host` resolves to, each one allowed (a listed IP literal stands for itself; a name's
    addresses must be public or in allowed_networks: a name with any other address is refused whole)."""
    try:
        return [str(ipaddress.ip_address(host))]  # an IP literal: check_url found it listed
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.run_in_executor(executor, socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    except OSError as e:
        raise CallbackRefused(f"callback host {host!r} does not resolve: {e}") from None
    addresses = list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))
    refused = [a for a in addresses if not address_allowed(ipaddress.ip_address(a), cfg)]
    if refused or not addresses:
        raise CallbackRefused(f"callback host {host!r} resolves to {', '.join(refused) or 'nothing'}: loopback, "
                              "private or link-local addresses need callbacks.allowed_networks")
    return addresses


def sign(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """Standard Webhooks' `webhook-signature`: v1, base64(HMAC-SHA256(key, "<id>.<timestamp>.<body>"))."""
    mac = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


class _CheckedResolver(AbstractResolver):
    """aiohttp connects to what this returns: the addresses `resolve` checked, in the same call (no second lookup
    for a DNS rebinding to slip into)."""

    def __init__(self, deliverer: "Deliverer"):
        self.deliverer = deliverer

    async def resolve(self, host, port=0, family=socket.AF_INET):
        addresses = await resolve(host, port, self.deliverer.config(), self.deliverer.dns)
        return [{"hostname": host, "host": a, "port": port, "family": socket.AF_INET6 if ":" in a else socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST} for a in addresses]

    async def close(self) -> None:
        pass


class Deliverer:
    """POSTs signed callbacks on its own client: at most `max_concurrent` connections, no connection reuse (every
    attempt resolves and checks again), no redirects, no proxy from the environment, `timeout_s` from connecting to
    the status line; DNS on its own two threads, never the request path's pool."""

    def __init__(self, config):
        self.config = config  # () -> CallbackConfig, read at each attempt (the file may be reloaded)
        self.dns = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="callback-dns")
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.config().max_concurrent, use_dns_cache=False,
                                             force_close=True, resolver=_CheckedResolver(self))
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False)
        return self._session

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        """The receiver's HTTP status; raises CallbackRefused, aiohttp.ClientError or asyncio.TimeoutError."""
        cfg = self.config()
        check_url(url, cfg)  # the allow-list may have changed since the job was submitted
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        async with asyncio.timeout(cfg.timeout_s + 1.0):  # the whole attempt, however slowly the bytes come
            async with self._client().post(url, data=body, headers=headers, allow_redirects=False,
                                           timeout=timeout) as resp:
                return resp.status

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.dns.shutdown(wait=False)
