"""The full pack's parallel reader: forked workers give the same bytes as one process, and a worker
that fails, runs out of room or is interrupted loses nothing and leaves no process behind."""

from __future__ import annotations

import os

import pytest

from m3_agent.agent.context import pack_repository
from m3_agent.agent.context import reader


def _files() -> dict[str, str | bytes]:
    """Enough files for several stripes per worker, with every kind of content the rules look at."""
    files: dict[str, str | bytes] = {f"pkg/mod{i:03}.py": f"def f{i}():\n    return {i}\n" for i in range(150)}
    files |= {f"docs/page{i:03}.md": f"# Page {i}\n\n```python\nx = {i}\n```\n" for i in range(60)}
    files |= {
        "fence.md": "````\n```\nnested\n```\n````\n",
        "latin1.txt": "caf\xe9 cr\xe8me\n".encode("latin-1"),
        "utf16.txt": "hello wörld\n".encode("utf-16"),
        "no_newline.py": "X = 1",
        "empty.py": "",
        "logo.png": b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR",
        "poetry.lock": "lock\n",
        "static/app.min.js": "var a=1;" * 400,
        "gen_pb2.py": "# generated\n",
        "big.txt": "x" * 5000,
        "日本/名前.txt": "テキスト\n",
    }
    return files


def _pack(root, monkeypatch, workers: int, **kw):
    """A pack by the Python reader (the C accelerator off) with `workers` processes."""
    monkeypatch.setattr(reader, "ACCELERATED", False)
    monkeypatch.setattr(reader, "workers_for", lambda n: workers)
    return pack_repository(root, cache=False, max_file_bytes=4096, **kw)


def _same(a, b) -> None:
    assert a.data == b.data
    assert a.files == b.files and a.skipped == b.skipped and a.tokens == b.tokens


def test_forked_workers_give_the_bytes_one_process_gives(repo, monkeypatch):
    root = repo(_files())
    os.symlink("pkg/mod001.py", root / "link.py")
    (root / "untracked.py").write_text("U = 1\n")
    serial = _pack(root, monkeypatch, 1)
    parallel = _pack(root, monkeypatch, 2)
    _same(parallel, serial)
    assert len(serial.files) > 3 * reader.STRIPE  # both workers had several stripes
    reasons = serial.skipped_by_reason()
    assert reasons == {"binary": 1, "generated": 1, "lockfile": 1, "minified": 1, "too-large": 1}
    text = serial.text
    assert "### link.py  (symlink to pkg/mod001.py)" in text and "### untracked.py" in text
    assert "### latin1.txt  (not UTF-8: decoded with replacement characters)" in text
    assert "`````md\n````\n```\nnested" in text  # the fence outgrows the file's own
    three = _pack(root, monkeypatch, 3, exclude=("docs/page00*",))
    assert three.data == _pack(root, monkeypatch, 1, exclude=("docs/page00*",)).data
    assert three.skipped_by_reason()["excluded"] == 10


def _in_workers(monkeypatch, misbehave) -> None:
    """Make every forked worker call `misbehave()` before each stripe; this process is left alone."""
    parent = os.getpid()
    real = reader._stripe

    def stripe(*args):
        if os.getpid() != parent:
            misbehave()
        return real(*args)

    monkeypatch.setattr(reader, "_stripe", stripe)


def test_a_failed_worker_leaves_its_share_to_the_caller(repo, monkeypatch):
    root = repo(_files())
    serial = _pack(root, monkeypatch, 1)

    def crash():
        raise RuntimeError("worker failure")

    _in_workers(monkeypatch, crash)
    _same(_pack(root, monkeypatch, 2), serial)


def test_a_full_region_falls_back_to_rendering_from_memory(repo, monkeypatch):
    files = {f"data/f{i:03}.txt": f"{i} " * 60_000 + "\n" for i in range(40)}  # about 9 MB: over a 1 MB region
    root = repo(files)
    serial = pack_repository(root, cache=False)
    monkeypatch.setattr(reader, "REGION_CAP", 1 << 20)
    monkeypatch.setattr(reader, "ACCELERATED", False)
    for workers in (1, 2):
        monkeypatch.setattr(reader, "workers_for", lambda n, w=workers: w)
        small = pack_repository(root, cache=False)
        _same(small, serial)
        assert len(small.files) == 40


def test_an_interrupted_pack_leaves_no_worker_behind(repo, monkeypatch):
    root = repo(_files())
    parent = os.getpid()
    real = reader._stripe
    calls = []

    def interrupt_the_caller(*args):
        if os.getpid() == parent:
            calls.append(args[1])
            if len(calls) == 1:  # Ctrl-C in its first stripe, the worker busy with its own
                raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(reader, "_stripe", interrupt_the_caller)
    with pytest.raises(KeyboardInterrupt):
        _pack(root, monkeypatch, 2)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # every worker was reaped: none left running or as a zombie


def test_workers_are_used_only_where_forking_is_safe_and_pays(monkeypatch):
    assert reader.workers_for(reader.PARALLEL_MIN_FILES - 1) == 1
    monkeypatch.setattr(reader._thread, "_count", lambda: 1)  # one thread besides this one
    assert reader.workers_for(10 * reader.PARALLEL_MIN_FILES) == 1  # threads: no fork
    monkeypatch.setattr(reader._thread, "_count", lambda: 0)
    monkeypatch.setattr(reader.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7}, raising=False)
    assert reader.workers_for(10 * reader.PARALLEL_MIN_FILES) == reader.MAX_WORKERS


def test_no_address_space_for_regions_still_packs_the_plain_way(repo, monkeypatch):
    root = repo(_files())
    serial = _pack(root, monkeypatch, 1)

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(reader.Region, "__init__", refuse)
    for workers in (1, 2):
        _same(_pack(root, monkeypatch, workers), serial)


def test_a_stuck_worker_is_killed_and_its_share_done_by_the_caller(repo, monkeypatch):
    import time

    root = repo(_files())
    serial = _pack(root, monkeypatch, 1)
    _in_workers(monkeypatch, lambda: time.sleep(3600))  # a lock that never comes free
    monkeypatch.setattr(reader, "WORKER_GRACE_S", 1.0)
    monkeypatch.setattr(reader, "WORKER_S_PER_ENTRY", 0.0)
    started = time.monotonic()
    _same(_pack(root, monkeypatch, 2), serial)
    assert time.monotonic() - started < 30
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def _decided(root, monkeypatch, inline: bool, accelerated: bool = False, limit: int = 4096) -> list[tuple]:
    """Every entry as `render_sections` leaves it: its fate, facts, and section bytes and frame."""
    from m3_agent.agent.context import layout
    from m3_agent.agent.context.selection import list_files

    monkeypatch.setattr(reader, "INLINE", inline)
    monkeypatch.setattr(reader, "ACCELERATED", accelerated)
    listing = list_files(root)
    entries = sorted(listing.entries, key=lambda e: layout.sort_key(e.path))
    reader.render_sections(entries, str(listing.root), None, None, limit, workers=1)
    out = []
    for e in entries:
        section = bytes(e.section[0][e.section[1]:e.section[2]]) if e.section else None
        out.append((e.path, e.reason, e.detail, e.forced, e.flags, e.size, e.blob,
                    e.facts.astuple() if e.facts else None, section, e.frame if e.section else None,
                    bytes(e.content) if e.content is not None else None))
    return out


def _every_case() -> dict[str, str | bytes]:
    """Files for each rule and each branch of the fast paths (Python's inline one and the C one)."""
    return _files() | {
        "ascii.py": "A = 1\n",
        "accents.txt": "déjà vu, naïve café\n",
        "no_newline_utf8.txt": "fin sans retour à la ligne",
        "nul_only.bin": b"\0",
        "control.txt": b"\x01\x02\x03 bell \x07\n",
        "a few controls.txt": b"tab\tfeed\x0c ok \x01\n" + b"plain text\n" * 20,
        "bom_odd.txt": b"\xff\xfe" + b"abc",
        "marker.py": "# @generated by a tool\nX = 1\n",
        "late_marker.py": "X = 1\n" * 300 + "# DO NOT EDIT\n",
        "small.min.css": "a{}\n",
        "app.js": "function f() {\n  return 1;\n}\n" * 100,
        "long_line.js": "var a=1;" * 400 + "\n",
        "fence_late.md": "text\n" * 50 + "```\ncode\n```\n",
        "inline_ticks.md": "use `x` and ``y`` here\n",
        "name with space.txt": "spaced\n",
        "vendor/lib.py": "V = 1\n",
        "max.txt": "y" * 4095 + "\n",
        "over.txt": "y" * 4097,
        "invalid/overlong.txt": b"\xc0\xaf slash\n",
        "invalid/surrogate.txt": b"\xed\xa0\x80 surrogate\n",
        "invalid/too_high.txt": b"\xf4\x90\x80\x80 past the last code point\n",
        "invalid/truncated.txt": b"caf\xc3",
        "valid/four_byte.txt": "emoji \U0001f600 and \u00e9\u4e2d\n",
        "valid/edge.txt": "\ud7ff \ue000 \U0010ffff\n",
        "node_modules/pkg/index.js": "module.exports = 1;\n",
        "src/vendor/x.c": "int x;\n",
        "a/dist/b/c.txt": "dist\n",
        "pkg.egg-info/PKG-INFO": "Name: pkg\n",
        "deep/mypkg.egg-info/top.txt": "top\n",
        "yarn.lock": "lock\n",
        "web/app.MIN.JS": "var a;\n",
        "web/app.js.map": "{}\n",
        "proto/m_pb2.py": "X = 1\n",
        ".hidden": "dotfile\n",
        "..dots.txt": "dots\n",
        "Makefile": "all:\n",
        "archive.tar.GZ": b"\x1f\x8b\x08\x00" + b"\0" * 20,
        "noext.": "no extension after the dot\n",
        "long.extension12": "eleven letters\n",
        "UPPER.PY": "X = 1\n",
        "weird-lang.c++": "int y;\n",
        "bom8.txt": "\ufeffwith a UTF-8 BOM\n",
    }


def _every_case_repo(repo):
    """A repository of `_every_case()`, with an untracked file and a changed one."""
    root = repo(_every_case())
    (root / "untracked.txt").write_text("not yet added\n")
    (root / "pkg" / "mod000.py").write_text("changed = True\n")
    return root


def test_the_inline_path_decides_and_renders_as_the_general_one(repo, monkeypatch):
    root = _every_case_repo(repo)
    general = _decided(root, monkeypatch, inline=False)
    inline = _decided(root, monkeypatch, inline=True)
    assert [g[0] for g in general] == [i[0] for i in inline]
    for g, i in zip(general, inline):
        assert i == g, g[0]
    assert {g[1] for g in general} >= {None, "binary", "generated", "minified", "too-large", "vendored"}


def test_the_c_accelerator_decides_and_renders_as_python_does(repo, monkeypatch, accelerator):
    root = _every_case_repo(repo)
    python = _decided(root, monkeypatch, inline=False)
    left = []
    real_accelerated = reader._accelerated

    def accelerated_spy(entries, todo, *args):
        rest = real_accelerated(entries, todo, *args)
        left.append((len(todo), len(rest)))
        return rest

    monkeypatch.setattr(reader, "_accelerated", accelerated_spy)
    accelerated = _decided(root, monkeypatch, inline=False, accelerated=True)
    for p, a in zip(python, accelerated):
        assert a == p, p[0]
    (todo, rest), = left
    assert 0 < rest < todo / 2  # most entries decided in C; the odd ones (fences of their own, ...) left to Python
    monkeypatch.setattr(reader, "threads_for", lambda n: 3)  # three threads claim the chunks
    assert _decided(root, monkeypatch, inline=False, accelerated=True) == python


def test_the_c_accelerator_reads_large_files_whole(repo, monkeypatch, accelerator):
    line = "x = 'a line of text that is not short'  # é\n"
    root = repo({
        "big/text.py": line * 3000,  # about 130 KB: past the first read
        "big/no_newline.txt": line * 2000 + "end",
        "big/binary.dat": b"\1\2\3" * 40000 + b"\0",
        "big/too_large.txt": "y" * 300_000,
        "big/just_fits.txt": "z" * 199_999 + "\n",
        "big/over_by_one.txt": "z" * 200_001,
        "big/generated.py": "# @generated\n" + line * 2000,
        "big/min.css": "a{b:c}" * 20000,
        "small.py": "S = 1\n",
    })
    python = _decided(root, monkeypatch, inline=False, limit=200_000)
    assert _decided(root, monkeypatch, inline=False, accelerated=True, limit=200_000) == python
    fates = {p[0]: p[1] for p in python}
    assert fates == {"big/text.py": None, "big/no_newline.txt": None, "big/binary.dat": "binary",
                     "big/too_large.txt": "too-large", "big/just_fits.txt": None, "big/over_by_one.txt": "too-large",
                     "big/generated.py": "generated", "big/min.css": "minified", "small.py": None}


def test_the_c_accelerator_leaves_what_does_not_fit_to_python(repo, monkeypatch, accelerator):
    root = repo({f"data/f{i:03}.txt": f"{i} " * 3000 + "\n" for i in range(300)})  # about 5 MB
    python = _decided(root, monkeypatch, inline=False)
    monkeypatch.setattr(reader, "REGION_CAP", 1 << 20)  # 1 MB per thread: most files go back to Python
    assert _decided(root, monkeypatch, inline=False, accelerated=True) == python


def test_a_packs_counts_agree_with_its_lists(repo):
    root = repo(_every_case())
    for budget in (None, 2500):
        pack = pack_repository(root, cache=False, max_file_bytes=4096, budget=budget,
                               issue="fence.md" if budget else None)
        by_reason, tokens = pack.skipped_by_reason(), pack.packed_tokens()  # before the lists are made
        assert pack.packed_count == len(pack.files) > 0
        assert tokens == sum(f.tokens for f in pack.files)
        assert by_reason == pack.skipped_by_reason() and sum(by_reason.values()) == len(pack.skipped)
        assert ("budget" in by_reason) == (budget is not None)


def _pack_text(root, monkeypatch, accelerated: bool) -> str:
    from m3_agent.agent.context import layout, selection

    for module in (reader, selection, layout):
        monkeypatch.setattr(module, "ACCELERATED", accelerated)
    return pack_repository(root, cache=False, max_file_bytes=4096).text


def test_a_full_pack_reads_tracked_files_while_git_lists_untracked_ones(repo, monkeypatch, accelerator):
    root = _every_case_repo(repo)
    started = []
    real = reader.start_scan
    monkeypatch.setattr(reader, "start_scan", lambda *a: started.append(len(a[0])) or real(*a))
    from m3_agent.agent.context import pack as pack_module

    monkeypatch.setattr(pack_module, "start_scan", reader.start_scan)
    fast = _pack_text(root, monkeypatch, True)
    assert started and started[0] == len(_every_case())  # the tracked files, before the untracked one was listed
    assert fast == _pack_text(root, monkeypatch, False)
    assert "### untracked.txt" in fast and "changed = True" in fast


def test_an_interrupt_while_the_scan_runs_leaves_no_thread(repo, monkeypatch, accelerator):
    import gc

    from m3_agent.agent.context import selection

    root = repo({f"f{i:04}.txt": f"{i}\n" * 100 for i in range(3000)})
    real = selection._finished
    calls = []

    def finished(root, calls_):
        calls.append(len(calls_))
        if len(calls) == 2:  # the untracked listing: the scan of tracked files is under way
            raise KeyboardInterrupt
        return real(root, calls_)

    monkeypatch.setattr(selection, "_finished", finished)
    threads = len(os.listdir("/proc/self/task"))  # (other tests may have left threads of their own)
    with pytest.raises(KeyboardInterrupt):
        pack_repository(root, cache=False)
    gc.collect()
    assert calls == [1, 2] and len(os.listdir("/proc/self/task")) == threads  # the scan's threads joined
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # and git's calls reaped
