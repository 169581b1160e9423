"""The encoding cache's disk tier (:mod:`rag_opt.models.cache_disk`) on real folders: its byte bound and LRU order,
two tiers sharing a folder as two processes would, every failure answered as a miss (counted, never raised), no
symbolic link followed, no lock file left, claims, the write-behind queue; and ``rag-opt cache stats|prune|clear``
over it."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rag_opt.cli import main
from rag_opt.cli.cache import scan
from rag_opt.errors import InvalidInputError
from rag_opt.models import cache_disk
from rag_opt.models.cache_disk import DEFAULT_DISK_BYTES, DiskTier, parse_size
from rag_opt.models.cache_store import StoreTier

WAIT = 60.0  # a bound on waits for the background threads (never reached: they finish in milliseconds)


def key(n: int) -> str:
    """A store key (64 hex digits) whose shard is ``n``'s two hex digits."""
    return f"{n:02x}" + "5e" * 31


def blob(n: int, size: int = 100) -> bytes:
    return bytes([n % 256]) * size


def entry(root: Path, k: str) -> Path:
    return root / k[:2] / f"{k}.safetensors"


def files(root: Path) -> list[str]:
    """Every file and link under ``root`` (relative paths), sorted."""
    out = []
    for base, dirs, names in os.walk(root):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(base, d))]:
            out.append(os.path.relpath(os.path.join(base, name), root))
    return sorted(out)


@pytest.fixture
def tiers() -> Iterator[list[DiskTier]]:
    """Tiers made by a test, closed at its end."""
    made: list[DiskTier] = []
    yield made
    for t in made:
        t.close()


Opener = Callable[..., DiskTier]


@pytest.fixture
def opened(tiers: list[DiskTier]) -> Opener:
    """Open a tier and wait for its first scan of the folder."""

    def make(root: Path, **kw: Any) -> DiskTier:
        t = DiskTier(root, **kw)
        tiers.append(t)
        t.stats()  # starts the scan
        assert t.flush(WAIT)
        return t

    return make


def age(path: Path, seconds: float) -> None:
    """Set ``path``'s modification time ``seconds`` in the past."""
    t = time.time() - seconds
    os.utime(path, (t, t))


# -- the protocol, the layout ----------------------------------------------------------------------------------------
def test_it_is_a_store_tier_writing_the_cli_layout_and_no_lock_files(tmp_path: Path, opened: Opener) -> None:
    t = opened(tmp_path, write_behind=False)
    assert isinstance(t, StoreTier) and t.name == "disk"
    for n in range(20):
        t.put(key(n), blob(n))
    assert files(tmp_path) == sorted(f"{key(n)[:2]}/{key(n)}.safetensors" for n in range(20))  # no .lock, no .tmp
    assert entry(tmp_path, key(3)).read_bytes() == blob(3)
    assert t.get(key(3)) == blob(3) and t.get(key(99)) is None
    assert t.contains(key(3)) and not t.contains(key(99)) and not t.contains("../etc")
    s = t.stats()
    assert (s.tier, s.hits, s.misses, s.writes, s.errors, s.entries, s.bytes) == ("disk", 1, 1, 20, 0, 20, 2000)
    assert (s.bytes_written, s.bytes_read, s.max_bytes, s.up) == (2000, 100, DEFAULT_DISK_BYTES, True)
    found = scan(tmp_path)
    assert (found.entries, found.bytes, found.foreign, found.other_files) == (20, 2000, [], [])


def test_options_are_checked(tmp_path: Path) -> None:
    bads: list[dict[str, Any]] = [{"max_bytes": 0}, {"max_bytes": True}, {"queue_bytes": -1}, {"lock_wait": -1.0}]
    for bad in bads:
        with pytest.raises(InvalidInputError):
            DiskTier(tmp_path, **bad)


def test_parse_size() -> None:
    assert parse_size("1048576") == 2**20 and parse_size(" 8GiB ") == 8 * 2**30 and parse_size("8gib") == 8 * 2**30
    assert parse_size("500MB") == 500 * 10**6 and parse_size("2kB") == 2000 and parse_size("1.5K") == 1536
    assert parse_size("3G") == 3 * 2**30 and parse_size("10B") == 10 and parse_size(7) == 7
    for bad in ("", "GiB", "8 GiBs", "-1", "iB", "1e3", "eight"):
        with pytest.raises(InvalidInputError):
            parse_size(bad)


# -- the bound -------------------------------------------------------------------------------------------------------
def test_the_bound_evicts_the_least_recently_used(tmp_path: Path, opened: Opener) -> None:
    t = opened(tmp_path, max_bytes=300, write_behind=False)
    for n in (1, 2, 3):
        t.put(key(n), blob(n))
    assert t.get(key(1)) == blob(1)  # 2 is now the least recently used
    t.put(key(4), blob(4))
    assert [entry(tmp_path, key(n)).exists() for n in (1, 2, 3, 4)] == [True, False, True, True]
    t.put(key(5), blob(5))  # then 3
    assert [entry(tmp_path, key(n)).exists() for n in (1, 3, 4, 5)] == [True, False, True, True]
    s = t.stats()
    assert (s.evictions, s.entries, s.bytes, s.max_bytes, s.errors) == (2, 3, 300, 300, 0)
    assert scan(tmp_path).bytes == 300


def test_an_entry_larger_than_the_bound_is_skipped(tmp_path: Path, opened: Opener) -> None:
    t = opened(tmp_path, max_bytes=300, write_behind=False)
    t.put(key(1), blob(1, 301))
    t.put(key(2), b"")
    assert files(tmp_path) == [] and t.stats().skipped == 2 and t.stats().writes == 0


def test_the_scan_learns_the_folder_and_the_bound_holds_over_it(tmp_path: Path, opened: Opener) -> None:
    first = opened(tmp_path, write_behind=False)
    for n in range(1, 6):
        first.put(key(n), blob(n))
        age(entry(tmp_path, key(n)), 1000 - n)  # 1 is the oldest
    first.close()
    t = opened(tmp_path, max_bytes=300, write_behind=False)  # it opens over the bound: the scan evicts
    assert (t.stats().entries, t.stats().bytes) == (3, 300)
    assert [entry(tmp_path, key(n)).exists() for n in range(1, 6)] == [False, False, True, True, True]
    assert t.stats().evictions == 2


def test_a_read_refreshes_the_modification_time(tmp_path: Path, opened: Opener) -> None:
    t = opened(tmp_path, write_behind=False)
    t.put(key(1), blob(1))
    age(entry(tmp_path, key(1)), 3600)
    assert t.get(key(1)) == blob(1)
    assert time.time() - entry(tmp_path, key(1)).stat().st_mtime < 600  # touched (now, not an hour ago)


# -- two processes on one folder -------------------------------------------------------------------------------------
def test_two_tiers_share_entries(tmp_path: Path, opened: Opener) -> None:
    a, b = opened(tmp_path, write_behind=False), opened(tmp_path, write_behind=False)
    a.put(key(1), blob(1))
    assert b.contains(key(1)) and b.get(key(1)) == blob(1)
    assert b.stats().entries == 1  # learned from its read
    b.put(key(1), blob(1))  # written by the other already: not again
    assert b.stats().writes == 0 and files(tmp_path) == [f"{key(1)[:2]}/{key(1)}.safetensors"]


def test_eviction_keeps_what_another_process_read_since(tmp_path: Path, opened: Opener) -> None:
    w = opened(tmp_path, write_behind=False)
    for n in (1, 2):
        w.put(key(n), blob(n))
    age(entry(tmp_path, key(1)), 2000)  # 1 older than 2
    age(entry(tmp_path, key(2)), 1000)
    a = opened(tmp_path, max_bytes=300, write_behind=False)
    b = opened(tmp_path, max_bytes=300, write_behind=False)
    assert b.get(key(1)) == blob(1)  # the other process uses 1: its modification time says so
    a.put(key(3), blob(3))
    a.put(key(4), blob(4))  # over the bound: a's oldest is 1, but 1 was read since; 2 goes
    assert [entry(tmp_path, key(n)).exists() for n in (1, 2, 3, 4)] == [True, False, True, True]
    assert a.stats().evictions == 1 and a.stats().errors == 0


def test_eviction_tolerates_entries_another_process_removed(tmp_path: Path, opened: Opener) -> None:
    w = opened(tmp_path, write_behind=False)
    for n in (1, 2, 3):
        w.put(key(n), blob(n))
        age(entry(tmp_path, key(n)), 1000 - n)
    a = opened(tmp_path, max_bytes=300, write_behind=False)
    b = opened(tmp_path, max_bytes=300, write_behind=False)
    assert b.prune(200) == (1, 100)  # b removes 1, the oldest
    a.put(key(4), blob(4))  # a still counts 1: evicting it finds it gone, and that is enough
    assert [entry(tmp_path, key(n)).exists() for n in (1, 2, 3, 4)] == [False, True, True, True]
    assert (a.stats().errors, a.stats().evictions, a.stats().bytes, a.stats().entries) == (0, 0, 300, 3)


# -- failures: answered as a miss, counted, never raised --------------------------------------------------------------
def test_a_full_or_read_only_disk_is_a_miss_counted_and_logged_once(
    tmp_path: Path, opened: Opener, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    t = opened(tmp_path, write_behind=False)
    codes = iter([errno.ENOSPC, errno.ENOSPC, errno.EROFS])

    def refuse(fd: int, data: bytes) -> None:
        code = next(codes)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(cache_disk, "_write_all", refuse)
    with caplog.at_level(logging.WARNING, logger="rag_opt.models.cache_disk"):
        for n in (1, 2, 3):
            t.put(key(n), blob(n))
    assert [f for f in files(tmp_path)] == []  # nothing kept, no temporary file left
    s = t.stats()
    assert (s.errors, s.writes, s.up) == (3, 0, False)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "No space left" in warned[0] and "Read-only" in warned[1]  # once a minute per kind
    assert t.get(key(1)) is None
    monkeypatch.undo()
    t.put(key(1), blob(1))  # the disk has room again
    assert t.get(key(1)) == blob(1) and t.stats().up


def test_a_write_behind_failure_is_counted_in_the_background(
    tmp_path: Path, opened: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = opened(tmp_path)

    def refuse(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_disk, "_write_all", refuse)
    t.put(key(1), blob(1))
    assert t.flush(WAIT)
    assert t.stats().errors == 1 and files(tmp_path) == [] and t.get(key(1)) is None


def test_a_folder_at_an_entry_path(tmp_path: Path, opened: Opener) -> None:
    t = opened(tmp_path, write_behind=False)
    entry(tmp_path, key(1)).mkdir(parents=True)
    assert t.get(key(1)) is None  # an empty folder: removed
    assert not entry(tmp_path, key(1)).exists()
    assert (t.stats().corrupt, t.stats().errors) == (1, 1)
    (entry(tmp_path, key(2)) / "inside").mkdir(parents=True)  # not empty: left alone, and nothing written over it
    t.put(key(2), blob(2))
    assert t.get(key(2)) is None
    assert entry(tmp_path, key(2)).is_dir() and (entry(tmp_path, key(2)) / "inside").is_dir()
    assert files(tmp_path) == [] and t.stats().errors >= 2 and t.stats().writes == 0


def test_a_link_at_an_entry_path_is_never_followed(tmp_path: Path, opened: Opener) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret"
    secret.write_bytes(b"not yours")
    t = opened(root, write_behind=False)
    entry(root, key(1)).parent.mkdir(parents=True)
    entry(root, key(1)).symlink_to(secret)
    assert t.get(key(1)) is None  # not read through: the link itself removed
    assert not entry(root, key(1)).is_symlink() and secret.read_bytes() == b"not yours"
    assert (t.stats().corrupt, t.stats().errors, t.stats().bytes_read) == (1, 1, 0)
    entry(root, key(1)).symlink_to(secret)
    t.put(key(1), blob(1))  # not written through: the link is replaced by the entry
    assert secret.read_bytes() == b"not yours" and files(outside) == ["secret"]
    assert not entry(root, key(1)).is_symlink() and entry(root, key(1)).read_bytes() == blob(1)


def test_a_linked_shard_is_never_read_or_written_through(tmp_path: Path, opened: Opener) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    planted = outside / f"{key(1)}.safetensors"
    planted.write_bytes(b"planted")
    t = opened(root, write_behind=False)
    (root / key(1)[:2]).symlink_to(outside, target_is_directory=True)
    assert t.get(key(1)) is None and not t.contains(key(1))
    t.put(key(1), blob(1))
    t.put(key(1)[:2] + "00" * 31, blob(2))  # another entry of that shard
    assert files(outside) == [planted.name] and planted.read_bytes() == b"planted"
    s = t.stats()
    assert s.errors == 3 and s.writes == 0 and s.hits == 0
    assert t.claim(key(1)) is True  # the entry stays memory-only: compute it
    assert files(outside) == [planted.name]
    t.put(key(2), blob(2))  # other shards work
    assert t.get(key(2)) == blob(2)


def test_a_file_where_a_shard_folder_should_be(tmp_path: Path, opened: Opener) -> None:
    t = opened(tmp_path, write_behind=False)
    (tmp_path / key(1)[:2]).write_bytes(b"a file")
    assert t.get(key(1)) is None
    t.put(key(1), blob(1))
    assert (tmp_path / key(1)[:2]).read_bytes() == b"a file"
    assert t.stats().errors == 2 and t.stats().writes == 0


def test_a_file_where_the_root_should_be(tmp_path: Path, tiers: list[DiskTier]) -> None:
    root = tmp_path / "root"
    root.write_bytes(b"a file")
    t = DiskTier(root, write_behind=False)
    tiers.append(t)
    t.put(key(1), blob(1))
    assert t.get(key(1)) is None and not t.contains(key(1))
    assert t.flush(WAIT)
    assert root.read_bytes() == b"a file" and t.stats().errors >= 3 and not t.stats().up


def test_a_root_that_disappears_is_not_recreated(tmp_path: Path, opened: Opener) -> None:
    root = tmp_path / "mount"
    t = opened(root, write_behind=False)
    t.put(key(1), blob(1))
    shutil.rmtree(root)
    assert t.get(key(1)) is None
    t.put(key(2), blob(2))
    assert not root.exists()  # maybe an unmounted volume: its mount point is not written to
    assert t.stats().errors == 2 and t.stats().writes == 1


def test_an_empty_file_a_fifo_and_a_bad_key_are_misses(tmp_path: Path, opened: Opener) -> None:
    t = opened(tmp_path, write_behind=False)
    entry(tmp_path, key(1)).parent.mkdir(parents=True)
    entry(tmp_path, key(1)).write_bytes(b"")
    assert t.get(key(1)) is None and not entry(tmp_path, key(1)).exists()
    assert (t.stats().corrupt, t.stats().errors) == (1, 0)  # an interrupted write: corrupt, not an error
    entry(tmp_path, key(2)).parent.mkdir(parents=True)
    os.mkfifo(entry(tmp_path, key(2)))
    assert t.get(key(2)) is None and not entry(tmp_path, key(2)).exists()  # not blocked on, removed
    assert (t.stats().corrupt, t.stats().errors) == (2, 1)
    for bad in ("../../etc/passwd", "ABCD", "", "a"):
        assert t.get(bad) is None
        t.put(bad, b"x")
    assert t.stats().errors == 9 and files(tmp_path) == []


def test_discard_removes_an_entry_the_cache_found_corrupt(tmp_path: Path, opened: Opener) -> None:
    t = opened(tmp_path, write_behind=False)
    t.put(key(1), blob(1))
    t.discard(key(1))
    assert not entry(tmp_path, key(1)).exists() and t.stats().corrupt == 1 and t.stats().entries == 0


# -- the write-behind queue -------------------------------------------------------------------------------------------
@pytest.fixture
def held_writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The writer thread waits in its write until the event is set (other threads write at once)."""
    go = threading.Event()
    write = cache_disk._write_all

    def held(fd: int, data: bytes) -> None:
        if threading.current_thread().name == "rag-opt-disk-tier":
            go.wait(WAIT)
        write(fd, data)

    monkeypatch.setattr(cache_disk, "_write_all", held)
    yield go
    go.set()


def test_the_queue_is_bounded_and_flush_writes_it(tmp_path: Path, opened: Opener, held_writer: threading.Event) -> None:
    t = opened(tmp_path, queue_bytes=250)
    t.put(key(1), blob(1))
    t.put(key(2), blob(2))
    t.put(key(3), blob(3))  # 300 queued bytes: over the bound, skipped
    t.put(key(1), blob(1))  # queued already
    assert t.get(key(2)) == blob(2) and t.contains(key(2))  # a queued entry is a hit before it is written
    assert not entry(tmp_path, key(2)).exists()
    assert not t.flush(0.0)  # the writer is held: not drained
    held_writer.set()
    assert t.flush(WAIT)
    assert [entry(tmp_path, key(n)).exists() for n in (1, 2, 3)] == [True, True, False]
    s = t.stats()
    assert (s.writes, s.skipped) == (2, 1)


def test_close_drains_the_queue_and_then_skips(tmp_path: Path, tiers: list[DiskTier]) -> None:
    t = DiskTier(tmp_path)
    tiers.append(t)
    for n in range(10):
        t.put(key(n), blob(n))
    t.close()
    assert all(entry(tmp_path, key(n)).read_bytes() == blob(n) for n in range(10))
    t.put(key(11), blob(11))
    t.close()  # idempotent
    assert not entry(tmp_path, key(11)).exists() and t.stats().skipped == 1
    assert t.get(key(3)) == blob(3)  # reads still work


# -- claims ----------------------------------------------------------------------------------------------------------
def claim_file(root: Path, k: str) -> Path:
    return root / k[:2] / f".{k}.claim"


def test_a_claim_is_exclusive_and_released(tmp_path: Path, opened: Opener) -> None:
    a = opened(tmp_path, write_behind=False, lock_wait=0.0)
    b = opened(tmp_path, write_behind=False, lock_wait=0.0)
    assert a.claim(key(1))
    assert a.claim(key(1))  # a holds it already
    info = json.loads(claim_file(tmp_path, key(1)).read_text())
    assert (info["pid"], info["host"]) == (os.getpid(), socket.gethostname())
    assert not b.claim(key(1)) and b.stats().skipped == 1  # another live claim
    found = scan(tmp_path)  # not an entry, not foreign
    assert (found.entries, found.claims, found.foreign) == (0, 1, [])
    a.put(key(1), blob(1))
    a.release(key(1))
    assert not claim_file(tmp_path, key(1)).exists()
    assert not b.claim(key(1))  # the entry exists now
    assert b.claim(key(2)) and not a.claim(key(2))
    b.release(key(2))  # released without an entry (the computation failed): free again
    assert a.claim(key(2))
    a.close()  # releases its claims
    assert files(tmp_path) == [f"{key(1)[:2]}/{key(1)}.safetensors"]
    assert a.claim(key(3)) and files(tmp_path) == [f"{key(1)[:2]}/{key(1)}.safetensors"]  # closed: no claim file


def test_a_release_waits_for_the_queued_write(tmp_path: Path, opened: Opener, held_writer: threading.Event) -> None:
    a = opened(tmp_path)
    b = opened(tmp_path, lock_wait=0.0)
    assert a.claim(key(1))
    a.put(key(1), blob(1))
    a.release(key(1))
    assert claim_file(tmp_path, key(1)).exists()  # still held: the entry is not on disk yet
    assert not b.claim(key(1))
    held_writer.set()
    assert a.flush(WAIT)
    assert not claim_file(tmp_path, key(1)).exists() and entry(tmp_path, key(1)).exists()
    assert not b.claim(key(1))  # the entry exists


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


@pytest.mark.parametrize(
    "holder",
    ["dead process", "expired", "unreadable", "link"],
)
def test_a_stale_claim_is_taken_over(tmp_path: Path, opened: Opener, holder: str) -> None:
    t = opened(tmp_path, write_behind=False, lock_wait=0.0)
    path = claim_file(tmp_path, key(1))
    path.parent.mkdir(parents=True)
    host = socket.gethostname()
    if holder == "dead process":
        path.write_text(json.dumps({"pid": dead_pid(), "host": host, "time": time.time()}))
    elif holder == "expired":
        path.write_text(json.dumps({"pid": os.getpid(), "host": "elsewhere", "time": time.time() - 301}))
    elif holder == "unreadable":  # its writer died making it
        path.write_bytes(b"")
        age(path, 60)
    else:
        (tmp_path / "target").write_text("x")
        path.symlink_to(tmp_path / "target")
    assert t.claim(key(1))
    assert json.loads(path.read_text())["pid"] == os.getpid() and not path.is_symlink()
    assert t.stats().skipped == 0
    t.release(key(1))
    assert not path.exists()
    assert sorted(p.name for p in path.parent.iterdir()) == []  # nothing renamed aside is left


def test_a_live_claim_elsewhere_is_respected(tmp_path: Path, opened: Opener) -> None:
    t = opened(tmp_path, write_behind=False, lock_wait=0.0)
    path = claim_file(tmp_path, key(1))
    path.parent.mkdir(parents=True)
    # another host: its pid cannot be checked here, only its age
    path.write_text(json.dumps({"pid": dead_pid(), "host": "elsewhere", "time": time.time()}))
    assert not t.claim(key(1))
    assert not t.claim(key(1), ttl=3600)
    path.write_bytes(b"")  # being written right now
    assert not t.claim(key(1))
    assert path.exists() and t.stats().skipped == 3
    assert t.claim(key(1), ttl=0.0)  # with no time to live, any claim is stale


# -- prune and old lock files ----------------------------------------------------------------------------------------
def test_prune_evicts_by_modification_time_and_removes_old_lock_files(tmp_path: Path, opened: Opener) -> None:
    w = opened(tmp_path, write_behind=False)
    for n in range(1, 6):
        w.put(key(n), blob(n))
        age(entry(tmp_path, key(n)), 1000 - n)
    lock = Path(f"{entry(tmp_path, key(1))}.lock")
    lock.write_bytes(b"")
    old_tmp, new_tmp = tmp_path / key(2)[:2] / f".{key(2)}.ab12.tmp", tmp_path / key(3)[:2] / f".{key(3)}.cd34.tmp"
    old_tmp.write_bytes(b"half")
    new_tmp.write_bytes(b"being written")
    age(old_tmp, 7200)
    left_claim, live_claim = claim_file(tmp_path, key(4)), claim_file(tmp_path, key(5))
    left_claim.write_text("{}")
    live_claim.write_text("{}")
    age(left_claim, 7200)
    (tmp_path / "notes.txt").write_text("mine")
    t = opened(tmp_path, write_behind=False)
    assert t.prune(250) == (3, 300)
    assert [entry(tmp_path, key(n)).exists() for n in range(1, 6)] == [False, False, False, True, True]
    assert not lock.exists() and not old_tmp.exists() and new_tmp.exists()
    assert not left_claim.exists() and live_claim.exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (t.stats().entries, t.stats().bytes, t.stats().evictions) == (2, 200, 3)
    assert t.prune() == (0, 0)
    with pytest.raises(InvalidInputError):
        t.prune(-1)


# -- rag-opt cache stats|prune|clear -----------------------------------------------------------------------------------
def fill(root: Path, count: int, size: int = 1000) -> None:
    t = DiskTier(root, write_behind=False)
    for n in range(count):
        t.put(key(n), blob(n, size))
        age(entry(root, key(n)), 1000 - n)
    t.close()


def test_cache_stats_shows_the_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path, 4)
    assert main(["cache", "stats", "--cache-dir", str(tmp_path), "--max-bytes", "8kB", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["entries"], stats["bytes"], stats["max_bytes"], stats["fill"]) == (4, 4000, 8000, 0.5)
    assert (stats["claims"], stats["legacy_locks"], stats["foreign_files"]) == (0, 0, 0)
    assert main(["cache", "stats", "--cache-dir", str(tmp_path), "--max-bytes", "2000"]) == 0
    out = capsys.readouterr().out
    assert "4 encodings, 4000 bytes" in out and "200.0% of the" in out and "rag-opt cache prune" in out
    assert "4 without an entry header" in out  # these test blobs are no safetensors entries
    assert main(["cache", "stats", "--cache-dir", str(tmp_path)]) == 0
    assert "of the 8.0 GiB bound" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["cache", "stats", "--cache-dir", str(tmp_path), "--max-bytes", "lots"])


def test_cache_prune_keeps_the_most_recently_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path, 5)
    Path(f"{entry(tmp_path, key(0))}.lock").write_bytes(b"")  # an older version's lock file
    assert main(["cache", "prune", "--cache-dir", str(tmp_path), "--max-bytes", "2500B"]) == 0
    out = capsys.readouterr().out
    assert "removed 3 encodings" in out and "2 left" in out
    assert [entry(tmp_path, key(n)).exists() for n in range(5)] == [False, False, False, True, True]
    assert scan(tmp_path).other_files == []
    assert main(["cache", "prune", "--cache-dir", str(tmp_path / "absent"), "--max-bytes", "1"]) == 2
    assert "cache folder not found" in capsys.readouterr().err


def test_cache_clear_removes_claims_and_old_lock_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path, 2)
    Path(f"{entry(tmp_path, key(0))}.lock").write_bytes(b"")
    claim_file(tmp_path, key(1)).write_text("{}")
    found = scan(tmp_path)
    assert (found.entries, found.claims, found.legacy_locks, found.foreign) == (2, 1, 1, [])
    assert main(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert "removed 2 encodings" in capsys.readouterr().out
    assert tmp_path.is_dir() and not any(tmp_path.iterdir())
