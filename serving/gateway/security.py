"""Authentication and TLS: API keys (metadata `authorization: Bearer <key>` or `x-api-key`) mapped to tenants,
admin keys for GatewayAdmin, checked before a request is decoded (`GatewayAuthInterceptor`), server TLS (optionally
requiring client certificates) and (mutual) TLS to instances. Keys are compared in constant time."""
from __future__ import annotations

import hmac

import grpc

from serving.auth import api_key_from_metadata
from serving.gateway.config import GatewayConfig, TenantConfig


# Who an admin key authenticates as: told apart by identity (`is ADMIN`), not by name; the name is reserved for it
# (serving.gateway.config.RESERVED_TENANT_NAMES).
ADMIN = TenantConfig(name="admin")


class AuthError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


class Authenticator:
    def __init__(self, config: GatewayConfig):
        self.reconfigure(config)

    def reconfigure(self, config: GatewayConfig) -> None:
        self.config = config
        self._keys = [(k, t) for t in config.tenants for k in t.api_keys]
        self._tenants = {t.name: t for t in config.tenants}

    def _match(self, key: str) -> TenantConfig | None:
        found = None
        for k, tenant in self._keys:  # no early exit: constant time over the key list
            if hmac.compare_digest(k.encode(), key.encode()):
                found = tenant
        return found

    def _is_admin(self, key: str) -> bool:
        return any([hmac.compare_digest(k.encode(), key.encode()) for k in self.config.admin_keys])

    def tenant(self, metadata, requested: str = "") -> TenantConfig | None:
        """The caller's tenant; None when auth is off (the request's own `tenant` field stands). Raises AuthError
        (UNAUTHENTICATED) for a missing or unknown key."""
        if not self.config.auth_enabled:
            return None
        key = api_key_from_metadata(metadata)
        if not key:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                            "no API key; send metadata `authorization: Bearer <key>`")
        tenant = self._match(key)
        if tenant is None:
            if self._is_admin(key):
                return ADMIN
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        return tenant

    def check_admin(self, metadata) -> None:
        key = api_key_from_metadata(metadata)
        if not self.config.admin_keys:
            if not self.config.auth_enabled:
                return  # auth off altogether: a dev setup
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED, "admin RPCs are disabled (no admin_keys configured)")
        if not key:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "no API key; admin RPCs need an admin key")
        if not self._is_admin(key):
            if self._match(key) is None:
                raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED, "this RPC needs an admin key")


ADMIN_METHODS = ("/meshserve.gateway.v1.GatewayAdmin/", "/meshserve.v1.Inference/Drain",
                 "/meshserve.v1.Inference/LoadLoRAAdapter", "/meshserve.v1.Inference/UnloadLoRAAdapter")
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # readiness probes send no credentials


class GatewayAuthInterceptor(grpc.aio.ServerInterceptor):
    """A call without a known key (or an admin RPC without an admin key) is refused from its metadata alone, before
    its request is read or decoded; the servicers then map the key to its tenant as before."""

    def __init__(self, auth: Authenticator, on_refused=None):
        self.auth = auth
        self._on_refused = on_refused or (lambda method, code: None)  # metrics: refused Generate calls

    async def intercept_service(self, continuation, details):
        method = details.method or ""
        if self.auth.config.auth_enabled and not method.startswith(OPEN_METHODS):
            try:
                if method.startswith(ADMIN_METHODS):
                    self.auth.check_admin(details.invocation_metadata)
                else:
                    self.auth.tenant(details.invocation_metadata)
            except AuthError as e:
                code, message = e.code, e.details
                self._on_refused(method, code)

                async def refuse(request_iterator, context):  # a stream handler: the request is never read
                    await context.abort(code, message)
                return grpc.stream_stream_rpc_method_handler(refuse)
        return await continuation(details)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS for the gateway's port; with client_ca, clients must present a certificate it signed (mutual TLS)."""
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=_read(client_ca) if client_ca
                                       else None, require_client_auth=bool(client_ca))


def instance_channel_credentials(tls: dict) -> grpc.ChannelCredentials | None:
    """From the config's instance_tls (ca, and cert + key for mutual TLS); None: plaintext."""
    if not tls:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(tls["ca"]) if "ca" in tls else None,
                                        private_key=_read(tls["key"]) if "key" in tls else None,
                                        certificate_chain=_read(tls["cert"]) if "cert" in tls else None)
