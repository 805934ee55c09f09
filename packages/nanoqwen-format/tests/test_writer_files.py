"""The writer's files on disk: the container's mode under several umasks, the temp file's name, the
stale temp file of a killed writer (removed and reported), a running write to the same path
(refused), and targets a rename must not replace (a directory, a FIFO)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import warnings

import nanoqwen_format as nqf
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(os.name != "posix", reason="modes, umask, flock and SIGKILL are POSIX")

SRC = os.path.dirname(os.path.dirname(nqf.__file__))  # so the child process imports this source tree


def _python(code: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True, **kw)


def _dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write(path, n: int = 3) -> None:
    with nqf.Writer(path) as w:
        for i in range(n):
            w.add_array(f"t{i}", np.arange(1000, dtype=np.float32), encoding="f32")


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002, 0o027])
def test_container_mode_is_0666_minus_umask(tmp_path, umask):
    # in a child process: the umask is process-wide; the child also checks the writer left it as it was
    path = tmp_path / "m.nanoqwen"
    path.write_bytes(b"old")
    os.chmod(path, 0o600)  # replaced, not kept: the new file gets 0666 & ~umask like any new file
    child = _python(f"""
        import os, numpy as np, nanoqwen_format as nqf
        os.umask({umask:#o})
        with nqf.Writer({str(path)!r}) as w:
            tmp = w._tmp
            print(oct(os.stat(tmp).st_mode & 0o777))
            w.add_array("x", np.ones(4, np.float32), encoding="f32")
        print(oct(os.umask(0)))
        """, stdout=subprocess.PIPE)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    tmp_mode, umask_after = out.split()
    assert int(tmp_mode, 8) == 0o666 & ~umask  # the kernel applied the umask at creation
    assert int(umask_after, 8) == umask
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    with nqf.open(path) as f:
        f.verify()


def test_temp_file_is_found_by_the_output_glob(tmp_path):
    path = tmp_path / "m.nanoqwen"
    with nqf.Writer(path) as w:
        w.add_array("x", np.ones(4, np.float32))
        during = sorted(p.name for p in tmp_path.glob("m.nanoqwen*"))
        assert len(during) == 1 and os.listdir(tmp_path) == during  # nothing hidden beside it
        assert nqf.partials.partial_pattern(path).fullmatch(during[0])
        assert during[0].startswith(f"m.nanoqwen.partial-{os.getpid()}-")
        assert not path.exists()
    assert os.listdir(tmp_path) == ["m.nanoqwen"]


def test_stale_temp_file_of_a_dead_process_is_removed_and_reported(tmp_path):
    path = tmp_path / "m.nanoqwen"
    pid = _dead_pid()
    stale = tmp_path / f"m.nanoqwen.partial-{pid}-x"
    stale.write_bytes(bytes(5000))
    report = rf"removed the stale temp file {stale.name} \(5000 bytes\)"
    with pytest.warns(nqf.PartialFileWarning, match=report):
        w = nqf.Writer(path)
        w.open()
    assert not stale.exists()
    assert [(p.pid, p.state, p.removed) for p in w.partials] == [(pid, "stale", True)]
    w.close()
    assert os.listdir(tmp_path) == ["m.nanoqwen"]


def test_on_partial_callback_replaces_the_warning(tmp_path):
    path = tmp_path / "m.nanoqwen"
    (tmp_path / f"m.nanoqwen.partial-{_dead_pid()}-1").write_bytes(b"ab")
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would fail the test
        with nqf.Writer(path, on_partial=seen.append) as w:
            w.add_array("x", np.ones(4, np.float32))
    assert [(p.state, p.removed, p.nbytes) for p in seen] == [("stale", True, 2)]
    assert os.listdir(tmp_path) == ["m.nanoqwen"]


def test_sigkilled_writer_leaves_a_temp_file_the_next_write_removes(tmp_path):
    path = tmp_path / "m.nanoqwen"
    child = _python(f"""
        import sys, time, numpy as np, nanoqwen_format as nqf
        w = nqf.Writer({str(path)!r})
        w.open()
        w.add_array("x", np.ones(100_000, np.float32), encoding="f32")
        w._fh.flush()
        print("writing", flush=True)
        time.sleep(120)
        """, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "writing"
        left = os.listdir(tmp_path)
        assert left == [f"m.nanoqwen.partial-{child.pid}-" + left[0].rsplit("-", 1)[1]]
        # while the child lives, its temp file is locked: a second write to the path is refused
        with pytest.raises(nqf.ConcurrentWriteError, match=f"process {child.pid}"):
            _write(path)
        assert os.listdir(tmp_path) == left
    finally:
        child.send_signal(signal.SIGKILL)  # nothing in the child can clean up
        child.wait(timeout=60)
    assert os.listdir(tmp_path) == left and (tmp_path / left[0]).stat().st_size > 400_000
    with pytest.warns(nqf.PartialFileWarning, match=f"removed the stale temp file {left[0]}"):
        _write(path)
    assert os.listdir(tmp_path) == ["m.nanoqwen"]
    with nqf.open(path) as f:
        f.verify()


def test_a_second_writer_to_the_same_path_is_refused(tmp_path):
    path = tmp_path / "m.nanoqwen"
    with nqf.Writer(path) as first:
        first.add_array("a", np.ones(8, np.float32))
        with pytest.raises(nqf.ConcurrentWriteError, match="another write to this file is running"):
            _write(path)
        first.add_array("b", np.ones(8, np.float32))  # untouched by the refused writer
    with nqf.open(path) as f:
        assert list(f.records) == ["a", "b"]
    assert os.listdir(tmp_path) == ["m.nanoqwen"]
    _write(tmp_path / "other.nanoqwen")  # another path in the same folder is not concerned


def test_unlocked_temp_file_of_a_live_process_is_left_alone(tmp_path):
    # a live PID without the lock: a reused PID, or a writer between creating and locking its file
    path = tmp_path / "m.nanoqwen"
    odd = tmp_path / f"m.nanoqwen.partial-{os.getpid()}-abc"
    legacy = tmp_path / ".m.nanoqwen.k2j4x9.partial"  # the hidden name of an older writer's partial files
    odd.write_bytes(b"x")
    legacy.write_bytes(b"y")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _write(path)
    msgs = sorted(str(w.message) for w in seen if issubclass(w.category, nqf.PartialFileWarning))
    assert len(msgs) == 2
    assert f"left the temp file {legacy.name}" in msgs[0] and "older nanoqwen writer" in msgs[0]
    assert f"left the temp file {odd.name}" in msgs[1] and f"process {os.getpid()} exists" in msgs[1]
    assert odd.exists() and legacy.exists()


def test_only_temp_files_of_the_same_path_are_touched(tmp_path):
    path = tmp_path / "m[1].nanoqwen"  # glob metacharacters in the name
    dead = _dead_pid()
    keep = [f"m[1].nanoqwen.partial-{dead}", f"m[1].nanoqwen.partial-x-{dead}", "m[1].nanoqwen.bak",
            f"other.nanoqwen.partial-{dead}-x", f"m1.nanoqwen.partial-{dead}-x",
            f"m[1].nanoqwen.partial-{dead}-x.y"]
    for name in keep:
        (tmp_path / name).write_bytes(b"keep")
    (tmp_path / f"m[1].nanoqwen.partial-{dead}-a1").write_bytes(b"stale")
    removed = nqf.clean_partials(path)
    assert [os.path.basename(p.path) for p in removed] == [f"m[1].nanoqwen.partial-{dead}-a1"]
    assert sorted(os.listdir(tmp_path)) == sorted(keep)


def test_live_write_is_refused_after_the_stale_files_are_removed(tmp_path):
    path = tmp_path / "m.nanoqwen"
    stale = tmp_path / f"m.nanoqwen.partial-{_dead_pid()}-0"
    stale.write_bytes(b"s")
    w = nqf.Writer(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nqf.PartialFileWarning)
        w.open()
    try:
        stale.write_bytes(b"s")
        with pytest.raises(nqf.ConcurrentWriteError):
            nqf.clean_partials(path)
        assert not stale.exists()
    finally:
        w.abort()
    assert os.listdir(tmp_path) == []


def test_directory_and_fifo_targets_are_refused_before_writing(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory"):
        _write(folder)
    link = tmp_path / "link.nanoqwen"
    link.symlink_to(folder)
    with pytest.raises(IsADirectoryError):
        _write(link)
    fifo = tmp_path / "pipe.nanoqwen"
    os.mkfifo(fifo)
    with pytest.raises(FileExistsError, match="not a regular file"):
        _write(fifo)
    assert sorted(os.listdir(tmp_path)) == ["link.nanoqwen", "out", "pipe.nanoqwen"]
    assert os.listdir(folder) == [] and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_symlink_to_a_file_is_replaced_by_the_container(tmp_path):
    # as in older writers: the rename replaces the link itself; the file it pointed to is untouched
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"keep me")
    link = tmp_path / "m.nanoqwen"
    link.symlink_to(target)
    _write(link)
    assert not link.is_symlink() and target.read_bytes() == b"keep me"
    with nqf.open(link) as f:
        f.verify()


def test_partial_file_report_is_one_line(tmp_path):
    p = nqf.PartialFile(str(tmp_path / "m.nanoqwen.partial-7-a"), 7, 512_000_000, "stale", True,
                        "process 7 is gone")
    assert str(p) == ("removed the stale temp file m.nanoqwen.partial-7-a (512.0 MB) of an interrupted "
                      "write: process 7 is gone")
    assert "\n" not in str(p)
