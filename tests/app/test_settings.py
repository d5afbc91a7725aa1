"""Settings: the default preset decodes; a bad file names the file, the key and what was
expected; the CLI's overrides land where they should."""

from __future__ import annotations

import pytest

from app.cli import _parser, main, settings_from
from config.settings import DEFAULT_PRESET, ConfigError, Settings, load_settings


def test_default_preset_is_one_embedded_pool_and_no_tenants():
    s = load_settings()
    assert load_settings(DEFAULT_PRESET) == s
    (pool,) = s.pools
    assert pool.model == "embedded" and pool.served_model_names == ["smollm2-135m-instruct"]
    assert s.tenants == [] and s.guardrails.input_url is None
    assert s.server.host == "127.0.0.1" and s.server.port == 8000
    assert pool.scheduler.max_running == max(pool.decode_buckets)
    # The preset writes out the library defaults: what `make serve` runs is what tests
    # and `Settings()` start from.
    assert s == Settings()


def test_chat_and_long_preset_pins_two_pools_to_their_own_devices():
    s = load_settings(DEFAULT_PRESET.with_name("chat-and-long.toml"))
    chat, long = s.pools
    assert chat.devices == [0, 1] and long.devices == [2, 3]
    assert chat.tensor_parallel == long.tensor_parallel == 2
    assert chat.max_prompt_tokens is not None and long.min_prompt_tokens > chat.max_prompt_tokens


@pytest.mark.parametrize("text, key, expected", [
    ("[server]\nport = 'eighty'\n", "$.server.port", "Expected `int`, got `str`"),
    ("[server]\nport = 70000\n", "$.server.port", "Expected `int` <= 65535"),
    ("[server]\nprot = 1\n", "$.server", "unknown field `prot`"),
    ("[[pools]]\npage_size = 0\n", "$.pools[0].page_size", "Expected `int` >= 1"),
    ("[[pools]]\nprefill_buckets = [[4, 16]]\n", "$.pools[0].prefill_buckets[0]",
     "Expected `int`, got `array`"),
    ("[[pools]]\nprefill_buckets = [16, 40]\n", "$.pools[0]",
     "prefill_buckets must be multiples of 16"),
    ("[[pools]]\nmixed_decode_buckets = [0, 4]\n", "$.pools[0]",
     "must include the largest decode bucket (16)"),
    ("[[pools]]\ndtype = 'float8'\n", "$.pools[0].dtype", "Invalid enum value 'float8'"),
    ("[[pools]]\n[pools.scheduler]\nmode = 'eager'\n", "$.pools[0].scheduler.mode",
     "Invalid enum value 'eager'"),
    ("[[pools]]\nmax_prompt_tokens = 5\nmin_prompt_tokens = 9\n", "$.pools[0]",
     "max_prompt_tokens (5) must be >= min_prompt_tokens (9)"),
    ("pools = []\n", "$.pools", "Expected `array` of length >= 1"),
    ("[[tenants]]\nname = 'a'\napi_key_sha256 = 'not-hex'\n", "$.tenants[0].api_key_sha256",
     "Expected `str` matching regex"),
    ("[[tenants]]\napi_key_sha256 = '" + "a" * 64 + "'\n", "$.tenants[0]",
     "missing required field `name`"),
    ("[[tenants]]\nname = 'a'\napi_key_sha256 = '" + "a" * 64 + "'\n[[tenants]]\nname = 'a'\n"
     "api_key_sha256 = '" + "b" * 64 + "'\n", "$", "duplicate tenant name: a"),
    ("[guardrails]\ninput_budget_ms = -1\n", "$.guardrails.input_budget_ms",
     "Expected `float` > 0.0"),
])
def test_bad_config_names_file_key_and_expectation(tmp_path, text, key, expected):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: {key}: "), msg
    assert expected in msg, msg


def test_unreadable_and_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read config"):
        load_settings(tmp_path / "nope.toml")
    bad = tmp_path / "syntax.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match=r"syntax\.toml: not valid TOML: .*line 1"):
        load_settings(bad)


def test_cli_bad_config_exits_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = 'x'\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"sluice: {bad}: $.server.port: Expected `int`, got `str`"


def test_cli_overrides():
    args = _parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "9000", "--model",
                                 "random:tiny", "--max-waiting", "3", "--scheduling",
                                 "static", "--no-prefix-cache", "--max-running", "8",
                                 "--no-overlap", "--ttft-slack", "1"])
    s = settings_from(args)
    assert (s.server.host, s.server.port) == ("0.0.0.0", 9000)
    pool = s.pools[0]
    assert pool.model == "random:tiny" and pool.served_model_names == ["tiny"]
    named = settings_from(_parser().parse_args(
        ["serve", "--model", "embedded:gemma3-270m", "--served-model-name", "g", "g2"]))
    assert named.pools[0].served_model_names == ["g", "g2"]
    assert (pool.scheduler.max_waiting, pool.scheduler.mode, pool.scheduler.prefix_cache) == (
        3, "static", False)
    assert (pool.scheduler.max_running, pool.scheduler.static_batch_size) == (8, 8)
    assert pool.scheduler.overlap is False
    assert pool.scheduler.ttft_slack == 1.0
    plain = settings_from(_parser().parse_args(["serve"]))
    assert plain.pools[0].scheduler.overlap is True
    assert plain == load_settings()
    tiers = settings_from(_parser().parse_args(
        ["serve", "--kv-host-bytes", "2GiB", "--kv-disk-dir", "/srv/kv"])).pools[0]
    assert (tiers.kv_host_bytes, tiers.kv_disk_dir) == (2 << 30, "/srv/kv")
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--kv-host-bytes", "lots"])
