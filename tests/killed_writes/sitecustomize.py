"""Fault injection for subprocess tests, active only when KILL_WRITE_DIR is set: the process SIGKILLs itself
halfway through the first write into the KILL_WRITE_COUNT-th file opened for writing directly in that folder
(one checkpoint save each), however the file is written: a Python file object, os.write or os.sendfile.

A run picks it up when this folder is on PYTHONPATH (Python imports `sitecustomize` at start-up)."""

import builtins
import io
import os
import signal

FOLDER = os.environ.get("KILL_WRITE_DIR")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR


def _inside(path) -> bool:
    try:
        return os.path.dirname(os.path.abspath(os.fsdecode(path))) == os.path.abspath(FOLDER)
    except TypeError:  # a file descriptor
        return False


class _Writes:
    def __init__(self) -> None:
        self.opened, self.fds = 0, set()

    def count(self, fd: int) -> bool:
        """Whether this newly opened file (descriptor `fd`) is the one to be cut off."""
        self.opened += 1
        if self.opened == int(os.environ.get("KILL_WRITE_COUNT", "1")):
            self.fds.add(fd)
        return fd in self.fds


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _HalfWritten:
    """A file object that writes half of what it is first given, then kills the process."""

    def __init__(self, file) -> None:
        self._file = file

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._file.write(view[: max(1, len(view) // 2)])
        self._file.flush()
        _die()

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


def _install() -> None:
    writes, real_os_open, real_open = _Writes(), os.open, io.open
    real_write, real_sendfile = os.write, os.sendfile

    def os_open(path, flags, *args, **kwargs):
        fd = real_os_open(path, flags, *args, **kwargs)
        if flags & WRITE_FLAGS and _inside(path):
            writes.count(fd)
        return fd

    def open_file(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if isinstance(file, int):
            return _HalfWritten(f) if file in writes.fds else f
        if any(c in mode for c in "wax+") and _inside(file) and writes.count(f.fileno()):
            return _HalfWritten(f)
        return f

    def write(fd, data):
        if fd in writes.fds:
            real_write(fd, memoryview(data)[: max(1, len(data) // 2)])
            _die()
        return real_write(fd, data)

    def sendfile(out_fd, in_fd, offset, count, *args, **kwargs):
        if out_fd in writes.fds:
            real_sendfile(out_fd, in_fd, offset, max(1, os.fstat(in_fd).st_size // 2))
            _die()
        return real_sendfile(out_fd, in_fd, offset, count, *args, **kwargs)

    os.open, io.open, builtins.open, os.write, os.sendfile = os_open, open_file, open_file, write, sendfile


if FOLDER:
    _install()
