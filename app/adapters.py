"""LoRA adapters as the HTTP layer sees them: which pool serves which adapter, loading and
unloading at run time, and who may ask for one.

A pool with `max_loras > 0` serves its base model and any number of adapters on it, each
addressed as `model = <adapter name>` (vLLM's convention). `PoolAdapters` is one pool's
registry: reading the files (a blocking `reader`, given by app/loading.py so that this
module needs no JAX) happens in a worker thread, and the adapter is then registered with
every replica's runner, which puts it in a device slot when a sequence needs it (the
scheduler's decision, scheduler/adapters.py).

Unloading takes the name away at once (new requests get 404) and tells each engine to
retire it: queued and running requests finish under it, and its weights go once the last
one ends. A name cannot be loaded again while its old weights are still in use.

Each load gets a generation number that goes into the prefix-cache salt, so an adapter
loaded again under the same name (other weights) never hits the old one's pages.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import trio

from .errors import APIError, bad_request, not_found
from .tenants import key_matches

if TYPE_CHECKING:
    from config.settings import ServerConfig

    from .pools import Pool, Router
    from .tenants import Tenant, Tenants

# (name, path) -> the adapter the runners take (model.lora.LoraAdapter); raises ValueError
# (model.lora.AdapterError) naming the file and tensor when it cannot be served.
Reader = Callable[[str, str], Any]
_generations = itertools.count(1)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    created: int  # unix time it was loaded
    generation: int  # unique per load: part of the prefix-cache salt
    rank: int
    targets: tuple[str, ...]


class PoolAdapters:
    """One pool's adapters."""

    def __init__(self, pool: Pool, reader: Reader | None) -> None:
        self.pool = pool
        self.reader = reader
        self.by_name: dict[str, AdapterInfo] = {}

    @property
    def enabled(self) -> bool:
        return self.reader is not None and self.pool.config.max_loras > 0

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def load_blocking(self, name: str, path: str) -> AdapterInfo:
        """Read the adapter and register it with every replica (a worker thread's job)."""
        assert self.reader is not None
        adapter = self.reader(name, path)
        for engine in self.pool.engines:
            engine.runner.add_adapter(adapter)
        info = AdapterInfo(name, str(path), int(time.time()), next(_generations),
                           getattr(adapter, "rank", 0), tuple(getattr(adapter, "targets", ())))
        self.by_name[name] = info
        return info

    def retiring(self, name: str) -> bool:
        """Unloaded, but requests still run under its old weights."""
        return any(name in e.scheduler.adapters.retired for e in self.pool.engines)

    def unload(self, name: str) -> None:
        del self.by_name[name]
        for engine in self.pool.engines:
            engine.retire_adapter(name)


async def load_adapter(router: Router, name: str, path: str, base_model: str | None
                       ) -> tuple[Pool, AdapterInfo]:
    """POST /v1/load_lora_adapter: checks, then reads the files off the event loop."""
    if not name or not path:
        raise bad_request("Send both `lora_name` and `lora_path`.", param="lora_name")
    pools = [p for p in router.pools if p.adapters.enabled]
    if base_model is not None:
        pools = [p for p in pools if base_model in p.config.served_model_names]
    if not pools:
        where = f" for base model `{base_model}`" if base_model else ""
        raise bad_request(f"No pool serves LoRA adapters{where} (set max_loras in a pool).",
                          param="base_model" if base_model else None, code="lora_disabled")
    if len(pools) > 1:
        raise bad_request("Several pools serve adapters: name one with `base_model` ("
                          + ", ".join(p.model_name for p in pools) + ").", param="base_model")
    pool = pools[0]
    if name in router.by_name or any(name in p.adapters for p in router.pools):
        raise bad_request(f"The lora adapter '{name}' has already been loaded (or the name is "
                          "a served model's).", param="lora_name", code="lora_exists")
    if pool.adapters.retiring(name):
        raise bad_request(f"The lora adapter '{name}' was unloaded and requests still run "
                          "under it; load it again once they have finished.",
                          param="lora_name", code="lora_retiring")
    try:
        info = await trio.to_thread.run_sync(pool.adapters.load_blocking, name, path)
    except ValueError as e:  # model.lora.AdapterError: names the file and the tensor
        raise bad_request(f"Cannot load LoRA adapter '{name}': {e}", param="lora_path",
                          code="invalid_lora") from None
    return pool, info


def unload_adapter(router: Router, name: str) -> Pool:
    """POST /v1/unload_lora_adapter: running requests finish, new ones get 404."""
    for pool in router.pools:
        if name in pool.adapters:
            pool.adapters.unload(name)
            return pool
    raise not_found(f"The lora adapter '{name}' cannot be found.", param="lora_name",
                    code="lora_not_found")


def is_admin(server: ServerConfig, authorization: str | None) -> bool:
    """Does the request carry the admin key (`Authorization: Bearer <key>`)?"""
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    return (scheme.lower() == "bearer" and bool(key) and server.admin_api_key_sha256 is not None
            and key_matches(key, server.admin_api_key_sha256))


def check_admin(server: ServerConfig, tenants: Tenants, authorization: str | None) -> None:
    """Only the admin key may load and unload adapters: 401 without a valid key, 403 for
    any other key (or when no admin key is configured)."""
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise APIError(401, "Missing API key: send `Authorization: Bearer <admin key>`.",
                       type="authentication_error", code="missing_api_key")
    if server.admin_api_key_sha256 is None:
        raise APIError(403, "Loading adapters at run time is off: configure "
                       "server.admin_api_key_sha256.", type="permission_error",
                       code="admin_disabled")
    if is_admin(server, authorization):
        return
    if tenants.lookup(key) is not None or tenants.open:
        raise APIError(403, "This key may not manage adapters (admin key needed).",
                       type="permission_error", code="admin_required")
    raise APIError(401, "Incorrect API key provided.", type="authentication_error",
                   code="invalid_api_key")


def check_tenant(tenant: Tenant, adapter: str) -> None:
    allowed = tenant.config.adapters
    if allowed is not None and adapter not in allowed:
        raise APIError(403, f"Tenant `{tenant.name}` may not use the adapter `{adapter}`.",
                       type="permission_error", param="model", code="adapter_not_allowed")
