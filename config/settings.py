"""Typed settings: msgspec frozen Structs decoded from TOML presets.

`load_settings(path)` decodes a TOML file into `Settings`; a bad file fails at start with
the file, the key and what was expected (msgspec's path, e.g. ``$.pools[0].page_size``).
"""

from __future__ import annotations

from typing import Literal

import msgspec


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-replica iteration policy."""

    mode: Literal["continuous", "static"] = "continuous"
    static_batch_size: int = 8  # static mode: gather up to N, run all to completion
    # Per-step caps. The sequence cap comes from the inter-token-latency target: more
    # sequences per step make every step (and so every token gap) longer.
    max_step_tokens: int = 512  # decode tokens + prefill tokens in one step
    max_running: int = 64  # sequences decoding at once
    max_waiting: int = 256  # bounded queue: requests
    max_waiting_tokens: int = 2_000_000  # bounded queue: prompt tokens waiting
    queue_deadline_s: float = 30.0  # shed a request that waited longer than this
    prefix_cache: bool = True
    share_prefix_across_tenants: bool = False
    kv_reserve_pages: int = 8  # admission keeps this many pages free for running decodes
    itl_target_s: float = 0.05


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scheduler: SchedulerConfig = SchedulerConfig()


def load_settings(path: str | None = None) -> Settings:
    """Decode a TOML preset; `None` gives the defaults."""
    if path is None:
        return Settings()
    with open(path, "rb") as f:
        data = f.read()
    try:
        return msgspec.toml.decode(data, type=Settings)
    except msgspec.ValidationError as e:
        raise SystemExit(f"{path}: invalid config: {e}") from None
    except msgspec.DecodeError as e:
        raise SystemExit(f"{path}: not valid TOML: {e}") from None
