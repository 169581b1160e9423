"""The shared (Redis) tier of the encoding cache, against a real redis-server of the tests' own (tests/redis_server.py).

Skipped, saying why, without redis-server on PATH or the redis client."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rag_opt.errors import ConfigurationError
from rag_opt.models.cache_store import StoreTier
from tests.redis_server import RedisServer, free_port, require_redis

KEY = "ab" * 32  # store keys are hex strings


def _blob(n: int, seed: int = 1) -> bytes:
    return bytes((i * 31 + seed) % 256 for i in range(n))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis()
    with RedisServer(tmp_path / "redis") as server:
        yield server


class _Clock:
    """A clock the test moves by hand (the tier's circuit breaker reads it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


PATIENT_S = 30.0  # the read timeout of tiers whose tests are not about timeouts (a loaded machine can take 50 ms)


def _tier(url: str, **kwargs: object):
    """A tier on ``url``; its reads wait up to :data:`PATIENT_S` unless a test sets ``timeout`` itself."""
    from rag_opt.models.cache_redis import RedisTier

    kwargs.setdefault("timeout", PATIENT_S)
    return RedisTier(url, **kwargs)  # type: ignore[arg-type]


def test_round_trip_and_counters(redis_server: RedisServer) -> None:
    with _tier(redis_server.url) as tier:
        assert isinstance(tier, StoreTier) and tier.name == "shared"
        assert tier.get(KEY) is None
        blob = _blob(10_000)
        tier.put(KEY, blob)
        assert tier.flush(timeout=10)
        assert tier.get(KEY) == blob
        s = tier.stats()
        assert (s.tier, s.hits, s.misses, s.writes, s.errors, s.corrupt, s.skipped) == ("shared", 1, 1, 1, 0, 0, 0)
        assert s.bytes_read == s.bytes_written == len(blob)
        assert s.read_seconds > 0 and s.write_seconds > 0
        assert s.up and s.bytes == 0 and s.entries == 0
        assert redis_server.client().get("ragopt:enc:" + KEY) == blob  # the key is namespace + key


def test_synchronous_writes(redis_server: RedisServer) -> None:
    with _tier(redis_server.url, write_behind=False) as tier:
        tier.put(KEY, b"x" * 100)
        assert redis_server.client().get("ragopt:enc:" + KEY) == b"x" * 100  # written before put returned
        assert tier.stats().writes == 1


def test_ttl_is_set(redis_server: RedisServer) -> None:
    with _tier(redis_server.url, ttl=100.0) as tier:
        tier.put(KEY, b"entry")
        assert tier.flush(timeout=10)
    pttl = redis_server.client().pttl("ragopt:enc:" + KEY)
    assert 50_000 < pttl <= 100_000


def test_two_tiers_share_entries(redis_server: RedisServer) -> None:
    with _tier(redis_server.url) as one, _tier(redis_server.url) as two:  # two workers or processes
        one.put(KEY, b"computed once")
        assert one.flush(timeout=10)
        assert two.get(KEY) == b"computed once"
        assert two.stats().hits == 1


def test_namespaces_are_isolated(redis_server: RedisServer) -> None:
    with _tier(redis_server.url, namespace="a:") as a, _tier(redis_server.url, namespace="b:") as b:
        a.put(KEY, b"from a")
        b.put(KEY, b"from b")
        assert a.flush(timeout=10) and b.flush(timeout=10)
        assert a.get(KEY) == b"from a" and b.get(KEY) == b"from b"
        a.put("cd" * 32, b"only in a")
        assert a.flush(timeout=10)
        assert b.get("cd" * 32) is None
    assert sorted(redis_server.client().keys("*")) == [b"a:" + KEY.encode(), b"a:" + b"cd" * 32, b"b:" + KEY.encode()]


def test_empty_entry_is_corrupt_and_deleted(redis_server: RedisServer) -> None:
    raw = redis_server.client()
    raw.set("ragopt:enc:" + KEY, b"")
    with _tier(redis_server.url) as tier:
        assert tier.get(KEY) is None
        assert tier.flush(timeout=10)  # the delete goes through the writer
        s = tier.stats()
        assert (s.corrupt, s.misses, s.hits, s.errors) == (1, 1, 0, 0)
    assert raw.exists("ragopt:enc:" + KEY) == 0


def test_entries_over_the_bound_and_empty_ones_are_skipped(redis_server: RedisServer) -> None:
    with _tier(redis_server.url, max_entry_bytes=1000) as tier:
        tier.put(KEY, b"y" * 1001)
        tier.put("cd" * 32, b"")
        tier.put("ef" * 32, b"y" * 1000)
        assert tier.flush(timeout=10)
        s = tier.stats()
        assert (s.skipped, s.writes) == (2, 1)
        assert tier.get(KEY) is None and tier.get("ef" * 32) == b"y" * 1000


def test_write_behind_queue_is_bounded_in_bytes(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = _tier(redis_server.url, queue_bytes=1000)
    release = threading.Event()
    real_store = tier._store

    def held_store(op: str, name: str, blob: bytes) -> None:
        assert release.wait(timeout=30)
        real_store(op, name, blob)

    monkeypatch.setattr(tier, "_store", held_store)  # the writer holds its first entry until released
    try:
        tier.put("a" * 64, b"1" * 500)  # queued or being written: 500 bytes held
        tier.put("b" * 64, b"2" * 400)  # 900
        tier.put("c" * 64, b"3" * 200)  # 1100 > 1000: skipped
        assert tier.stats().skipped == 1
        assert not tier.flush(timeout=0.05)  # held: not drained
        release.set()
        assert tier.flush(timeout=10)
        assert tier.get("a" * 64) == b"1" * 500 and tier.get("b" * 64) == b"2" * 400
        assert tier.get("c" * 64) is None
        s = tier.stats()
        assert (s.writes, s.skipped) == (2, 1)
        tier.put("c" * 64, b"3" * 200)  # the queue drained: room again
        assert tier.flush(timeout=10) and tier.get("c" * 64) == b"3" * 200
    finally:
        release.set()
        tier.close()


def test_close_drains_then_refuses(redis_server: RedisServer) -> None:
    tier = _tier(redis_server.url)
    tier.put(KEY, b"kept at close")
    tier.close()
    tier.close()  # idempotent
    assert redis_server.client().get("ragopt:enc:" + KEY) == b"kept at close"
    assert tier.get(KEY) is None  # closed: a miss, no connection
    tier.put("cd" * 32, b"late")
    assert tier.stats().skipped == 1
    assert redis_server.client().exists("ragopt:enc:" + "cd" * 32) == 0


def test_server_down_then_back(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    clock = _Clock()
    tier = _tier(redis_server.url, retry_after=5.0)
    monkeypatch.setattr(tier, "_clock", clock)
    try:
        tier.put(KEY, b"before")
        assert tier.flush(timeout=10) and tier.get(KEY) == b"before"

        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="rag_opt.models.cache_redis"):
            assert tier.get(KEY) is None  # no exception: a miss
        s = tier.stats()
        assert s.errors == 1 and not s.up and s.misses == 1
        assert any("unreachable" in r.getMessage() for r in caplog.records)

        # the breaker is open: calls are skipped, not tried (no new errors), until retry_after has passed
        for _ in range(5):
            assert tier.get(KEY) is None
            tier.put(KEY, b"while down")
        assert tier.flush(timeout=10)
        s = tier.stats()
        assert s.errors == 1 and s.misses == 6 and s.skipped == 5 and not s.up

        clock.now += 4.9
        assert tier.get(KEY) is None and tier.stats().errors == 1  # still skipped
        clock.now += 0.2
        assert tier.get(KEY) is None  # one probe: tried, failed, down again for retry_after
        assert tier.stats().errors == 2 and not tier.stats().up
        assert tier.get(KEY) is None and tier.stats().errors == 2

        redis_server.start()  # back on the same port, empty (nothing is saved)
        assert tier.get(KEY) is None and tier.stats().errors == 2  # still within retry_after
        clock.now += 5.1
        assert tier.get(KEY) is None  # the probe reaches it: a plain miss, and the tier is up
        s = tier.stats()
        assert s.up and s.errors == 2
        tier.put(KEY, b"after")
        assert tier.flush(timeout=10) and tier.get(KEY) == b"after"
    finally:
        tier.close()


def test_writes_fail_while_the_store_is_gone(redis_server: RedisServer) -> None:
    tier = _tier(redis_server.url, retry_after=60.0)
    try:
        assert tier.get(KEY) is None  # connected once
        redis_server.stop()
        tier.put(KEY, b"lost")  # the background write fails: counted, not raised
        assert tier.flush(timeout=10)
        s = tier.stats()
        assert s.errors == 1 and s.writes == 0 and not s.up
        assert tier.get(KEY) is None and tier.stats().errors == 1  # the failed write opened the breaker for reads too
    finally:
        tier.close()


def test_hung_store_times_out(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    tier = _tier(redis_server.url, timeout=0.05, retry_after=5.0)
    monkeypatch.setattr(tier, "_clock", clock)
    try:
        tier.put(KEY, b"entry")
        assert tier.flush(timeout=10) and tier.get(KEY) == b"entry"
        redis_server.freeze()  # connected, but nothing answers
        try:
            assert tier.get(KEY) is None  # the read times out: a miss
            s = tier.stats()
            assert s.errors == 1 and not s.up
            assert tier.get(KEY) is None and tier.stats().errors == 1  # skipped, not waited for again
        finally:
            redis_server.thaw()
        clock.now += 5.1
        assert tier.get(KEY) == b"entry" and tier.stats().up
    finally:
        tier.close()


def test_nothing_listening() -> None:
    require_redis()
    port = free_port()
    for write_behind in (True, False):
        with _tier(f"redis://127.0.0.1:{port}/0", write_behind=write_behind) as tier:
            assert tier.get(KEY) is None
            tier.put(KEY, b"nowhere")
            assert tier.flush(timeout=10)
            s = tier.stats()
            assert s.errors == 1 and s.misses == 1 and s.writes == 0 and not s.up


def test_store_evicts_under_maxmemory(tmp_path: Path) -> None:
    require_redis()
    config = {"maxmemory": "4mb", "maxmemory-policy": "allkeys-lru", "maxmemory-samples": "10"}
    with RedisServer(tmp_path / "redis", config=config) as server, _tier(server.url) as tier:
        keys = [f"{i:064x}" for i in range(40)]
        for i, key in enumerate(keys):  # 40 x 200 kB = 8 MB into 4 MB
            tier.put(key, _blob(200_000, seed=i))
            assert tier.flush(timeout=10)
        raw = server.client()
        assert raw.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        gone = [k for k in keys if not raw.exists("ragopt:enc:" + k)]
        assert gone and len(gone) < len(keys)
        before = tier.stats()
        assert before.writes == 40 and before.errors == 0
        assert tier.get(gone[0]) is None
        after = tier.stats()
        assert after.misses == before.misses + 1 and after.errors == 0 and after.up
        kept = next(k for k in keys if k not in gone)
        assert tier.get(kept) == _blob(200_000, seed=keys.index(kept))


def test_unix_socket(tmp_path: Path) -> None:
    require_redis()
    with RedisServer(tmp_path / "redis", unixsocket=tmp_path / "redis.sock") as server:
        assert server.url.startswith("unix://")
        with _tier(server.url) as tier:
            tier.put(KEY, b"over a socket")
            assert tier.flush(timeout=10) and tier.get(KEY) == b"over a socket"


def test_valkey_scheme_reads_as_redis(redis_server: RedisServer) -> None:
    url = redis_server.url.replace("redis://", "valkey://")
    with _tier(url) as tier:
        tier.put(KEY, b"valkey")
        assert tier.flush(timeout=10) and tier.get(KEY) == b"valkey"


@pytest.mark.parametrize(
    "url",
    ["http://user:hunter2@example.com:6379/0", "memcached://127.0.0.1:11211", "127.0.0.1:6379", "", "redis:/x"],
)
def test_bad_url_is_a_configuration_error(url: str) -> None:
    pytest.importorskip("redis", reason="the redis client is not installed (pip install 'ragsieve[redis]')")
    with pytest.raises(ConfigurationError) as info:
        _tier(url)
    message = str(info.value)
    assert "redis://" in message and "rediss://" in message and "unix://" in message and "valkey://" in message
    assert "hunter2" not in message
    if url.startswith("http"):
        assert "http://user:***@example.com:6379/0" in message


def test_bad_port_is_a_configuration_error() -> None:
    pytest.importorskip("redis", reason="the redis client is not installed (pip install 'ragsieve[redis]')")
    with pytest.raises(ConfigurationError, match=r"redis://:\*\*\*@localhost:notaport"):
        _tier("redis://:hunter2@localhost:notaport/0")


@pytest.mark.parametrize(
    ("option", "value"),
    [("ttl", 0), ("timeout", -1), ("retry_after", 0), ("queue_bytes", 0), ("max_entry_bytes", 1.5)],
)
def test_bad_options_are_configuration_errors(option: str, value: object) -> None:
    pytest.importorskip("redis", reason="the redis client is not installed (pip install 'ragsieve[redis]')")
    with pytest.raises(ConfigurationError, match=option):
        _tier("redis://127.0.0.1:6379/0", **{option: value})


def test_url_timeouts_cannot_override_the_tier() -> None:
    pytest.importorskip("redis", reason="the redis client is not installed (pip install 'ragsieve[redis]')")
    from rag_opt.models.cache_redis import RedisTier

    with RedisTier("redis://127.0.0.1:6379/0?socket_timeout=30&decode_responses=True&max_connections=7") as tier:
        kwargs = tier._pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.05 and kwargs["decode_responses"] is False
        assert tier._pool.max_connections == 7  # other query options are honored


def test_missing_client_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "redis", None)  # "import redis" raises ImportError
    with pytest.raises(ConfigurationError, match=r"pip install 'ragsieve\[redis\]'"):
        _tier("redis://127.0.0.1:6379/0")


def test_redacted_url() -> None:
    from rag_opt.models.cache_redis import redacted_url

    assert redacted_url("redis://:hunter2@cache:6379/0") == "redis://:***@cache:6379/0"
    assert redacted_url("rediss://app:hunter2@cache.example.com:6380/1") == "rediss://app:***@cache.example.com:6380/1"
    assert redacted_url("redis://app@cache:6379") == "redis://app@cache:6379"  # a user name alone is no secret
    assert redacted_url("redis://cache:6379/0") == "redis://cache:6379/0"
    assert redacted_url("unix:///run/redis.sock?db=2&password=hunter2") == "unix:///run/redis.sock?db=2&password=***"
    assert redacted_url("redis://:p@ss:w@rd@cache:6379/0") == "redis://:***@cache:6379/0"
    assert redacted_url("redis://:pa/ss@cache:6379/0") == "redis://:***@cache:6379/0"  # an unescaped slash
    assert redacted_url("unix:///run/a@b.sock") == "unix:///run/a@b.sock"
    assert "hunter2" not in redacted_url("redis://:hunter2@[::1:6379/0")  # one urlsplit cannot read


def test_logs_never_show_the_password(caplog) -> None:
    require_redis()
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="rag_opt.models.cache_redis"):
        with _tier(f"redis://:hunter2@127.0.0.1:{port}/0") as tier:
            assert tier.get(KEY) is None
            assert "hunter2" not in repr(tier)
    assert caplog.records and all("hunter2" not in r.getMessage() for r in caplog.records)
