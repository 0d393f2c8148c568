"""The count cache: keyed by git blob id and counter, under M3_AGENT_CACHE_DIR, never required."""

from __future__ import annotations

import json

from m3_agent.agent.context import PackCache, TokenizerJsonCounter, cache_dir, pack_repository
from m3_agent.agent.context.cache import CACHE_FILE


class RecordingCounter:
    """A real tokenizer.json counter that records which texts it was asked to count per file."""

    kind = "tokenizer.json"

    def __init__(self, inner: TokenizerJsonCounter) -> None:
        self.inner = inner
        self.id = inner.id
        self.batches: list[list[str]] = []

    def count_many(self, texts: list[str]) -> list[int]:
        self.batches.append(list(texts))
        return self.inner.count_many(texts)

    def count(self, text: str) -> int:
        return self.inner.count(text)

    def counted(self) -> list[str]:
        return [t for batch in self.batches for t in batch]


FILES = {"a.py": "A = 1\n", "b.py": "def b():\n    return 2\n", "c/d.py": "D = [1, 2, 3]\n"}


def test_counts_are_cached_by_blob_and_counter(repo, tokenizer_json, private_cache):
    root = repo(FILES)
    first = RecordingCounter(TokenizerJsonCounter(tokenizer_json))
    pack1 = pack_repository(root, counter=first)
    assert sorted(first.counted()) == sorted(FILES.values())
    assert (private_cache / CACHE_FILE).is_file()

    again = RecordingCounter(TokenizerJsonCounter(tokenizer_json))
    pack2 = pack_repository(root, counter=again)
    assert again.counted() == []  # every file's count came from the cache
    assert pack2.text == pack1.text and pack2.tokens == pack1.tokens
    assert [f.tokens for f in pack2.files] == [f.tokens for f in pack1.files]

    (root / "b.py").write_text("def b():\n    return 3\n")
    changed = RecordingCounter(TokenizerJsonCounter(tokenizer_json))
    pack_repository(root, counter=changed)
    assert changed.counted() == ["def b():\n    return 3\n"]  # only the new content is counted


def test_a_different_tokenizer_does_not_reuse_counts(repo, tokenizer_json, tmp_path):
    root = repo(FILES)
    pack_repository(root, counter=RecordingCounter(TokenizerJsonCounter(tokenizer_json)))
    other_json = tmp_path / "other.json"
    other_json.write_text(json.dumps(json.loads(tokenizer_json.read_text()), indent=1))  # other bytes
    other = RecordingCounter(TokenizerJsonCounter(other_json))
    assert other.id != TokenizerJsonCounter(tokenizer_json).id
    pack_repository(root, counter=other)
    assert sorted(other.counted()) == sorted(FILES.values())


def test_same_content_at_another_path_or_repository_hits_the_cache(repo, tokenizer_json):
    root = repo(FILES, name="one")
    pack_repository(root, counter=RecordingCounter(TokenizerJsonCounter(tokenizer_json)))
    twin = repo({"x/y.py": FILES["a.py"], "new.py": "NEW = 1\n"}, name="two")
    rec = RecordingCounter(TokenizerJsonCounter(tokenizer_json))
    pack_repository(twin, counter=rec)
    assert rec.counted() == ["NEW = 1\n"]


def test_cache_can_be_switched_off(repo, tokenizer_json, private_cache):
    root = repo(FILES)
    rec = RecordingCounter(TokenizerJsonCounter(tokenizer_json))
    pack_repository(root, counter=rec, cache=False)
    pack_repository(root, counter=rec, cache=False)
    assert len(rec.counted()) == 2 * len(FILES)
    assert not (private_cache / CACHE_FILE).exists()


def test_a_corrupt_cache_file_is_ignored(repo, private_cache):
    root = repo(FILES)
    (private_cache / CACHE_FILE).write_bytes(b"this is not a database" * 100)
    pack = pack_repository(root)
    assert [f.path for f in pack.files] == ["a.py", "b.py", "c/d.py"]


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("M3_AGENT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "m3-agent"


def test_facts_are_cached_so_unchanged_files_are_not_reread(repo, private_cache, git, monkeypatch):
    from m3_agent.agent.context import reader

    root = repo({"keep.py": "K = 1\n", "bin.dat": b"\0\1\2\3", "big.txt": "x" * 3000})
    pack_repository(root, max_file_bytes=2000)
    blob = git(root, "rev-parse", "HEAD:bin.dat").strip()
    with PackCache(private_cache) as store:
        assert store.get_facts([blob])[blob].binary
    reads: list[str] = []
    real = reader.read_bytes
    monkeypatch.setattr(reader, "read_bytes", lambda path, limit: reads.append(path) or real(path, limit))
    pack = pack_repository(root, max_file_bytes=2000)
    # The binary file's facts come from the cache; the oversized one is only opened for its size.
    assert sorted(p.rsplit("/", 1)[-1] for p in reads) == ["big.txt", "keep.py"]
    assert {s.path: s.reason for s in pack.skipped} == {"bin.dat": "binary", "big.txt": "too-large"}


def test_a_warm_pack_reads_the_facts_of_the_whole_index_in_one_snapshot(repo, private_cache, monkeypatch):
    root = repo({f"m{i}.py": f"V = {i}\n" for i in range(40)} | {"img.bin": b"\0\1"})
    first = pack_repository(root)
    lookups: list[int] = []
    real = PackCache.get_facts
    monkeypatch.setattr(PackCache, "get_facts", lambda self, blobs: lookups.append(len(blobs)) or real(self, blobs))
    second = pack_repository(root)
    assert lookups == []  # every tracked blob's facts came with the snapshot
    assert second.data == first.data
    (root / "new.py").write_text("NEW = 1\n")  # untracked: read, not looked up
    (root / "m3.py").write_text("V = 'changed'\n")  # changed: read, not looked up
    third = pack_repository(root)
    assert lookups == []
    assert "V = 'changed'" in third.text and "NEW = 1" in third.text


def test_workers_opening_a_new_cache_at_the_same_moment_all_get_it(tmp_path):
    """SQLite refuses the switch to WAL at once, without waiting, while another connection sets up the same
    new file: one eval worker in eight silently ran without the cache (and its batch's stored order)."""
    import threading

    disabled = 0
    for n in range(60):
        barrier, opened = threading.Barrier(3), []

        def open_it(folder=tmp_path / f"fresh-{n}"):
            barrier.wait()
            with PackCache(folder) as store:
                store.put_scores({"k": [1]})
                opened.append(store.get_scores("k") == [1])

        threads = [threading.Thread(target=open_it) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        disabled += opened.count(False)
    assert disabled == 0
