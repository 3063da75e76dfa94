"""All-or-nothing directory writes: stage beside the target, fsync, swap in.

A save into ``target`` writes everything into ``.<name>.hf-ext-new`` next to it (the same filesystem), fsyncs every
file and directory there, then swaps it in:

* on Linux, one ``renameat2(RENAME_EXCHANGE)``: the target path names the complete old directory until the instant it
  names the complete new one;
* elsewhere (or on a filesystem that refuses the exchange), the old directory is renamed aside to
  ``.<name>.hf-ext-old``, the new one renamed in, the old one deleted. A kill between the two renames leaves no
  ``target`` for an instant; the next :func:`recover` finishes the swap.

Entries of the old directory that the new content does not replace and that are not weights (``checkpoint-N``,
logs, results, a tokenizer saved earlier) are carried over into the new one before the swap, so that a final save
into a run's ``output_dir`` keeps its checkpoints: hard-linked file by file (copied where the filesystem has no hard
links), never moved, so that the swap is the only step that changes what ``target`` holds. Until the swap, the staged
directory lists its own entries in ``.hf-ext-staged.json``; :func:`recover` gives carried entries back to the target
(those an earlier version moved out of it), removes every leftover of an interrupted write (staged, old and work
directories) and is called by the next write into the same target, by the trainer at start and by ``hf-ext
export``. Nothing is ever loaded from a leftover: they are hidden siblings.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import logging
import os
import shutil
import uuid
from glob import escape as glob_escape
from pathlib import Path

logger = logging.getLogger(__name__)

STAGED_SUFFIX = ".hf-ext-new"
OLD_SUFFIX = ".hf-ext-old"
WORK_SUFFIX = ".hf-ext-work"
MANIFEST = ".hf-ext-staged.json"


def staged_path(target: str | Path) -> Path:
    """Where a write into ``target`` is staged (the same on every rank, so every rank can write its part there)."""
    target = Path(target).absolute()
    return target.with_name(f".{target.name}{STAGED_SUFFIX}")


def old_path(target: Path) -> Path:
    return target.with_name(f".{target.name}{OLD_SUFFIX}")


def work_path(target: str | Path) -> Path:
    """A scratch directory beside ``target`` (same filesystem) for intermediate files; removed by :func:`recover`."""
    target = Path(target).absolute()
    return target.with_name(f".{target.name}{WORK_SUFFIX}")


# ----------------------------------------------------------------------------------------------------------------
# durable bytes
# ----------------------------------------------------------------------------------------------------------------


def fsync_path(path: str | Path) -> None:
    """Flush a file's or a directory's data and metadata to the disk."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if Path(path).is_dir() else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:  # pragma: no cover - platforms that cannot open directories (Windows)
        return
    try:
        os.fsync(fd)
    except OSError as err:  # some filesystems cannot fsync a directory; files must succeed
        if Path(path).is_file() or err.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and directory under ``root``, children before their directory."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_path(path)
        fsync_path(dirpath)


@contextlib.contextmanager
def atomic_file(path: str | Path):
    """One file, all-or-nothing, written by whatever writes a path: yields a temporary path beside ``path`` to write;
    once the block ends it is fsynced, renamed over ``path`` and the directory fsynced; when the block raises it is
    removed and ``path`` is untouched. The temporary name is the writer's own, so that concurrent writers of one path
    never share it (the last rename wins, whole); a killed writer's is removed by :func:`remove_file_leftovers`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def remove_file_leftovers(path: str | Path) -> list[Path]:
    """Remove what killed :func:`atomic_file` writers of ``path`` left beside it (and its :func:`work_path`); for a
    writer that knows it is the path's only one. Returns what was removed."""
    path = Path(path)
    leftovers = sorted(path.parent.glob(f".{glob_escape(path.name)}.*.tmp"))
    for leftover in leftovers:
        leftover.unlink(missing_ok=True)
    if work_path(path).exists():
        shutil.rmtree(work_path(path), ignore_errors=True)
        leftovers.append(work_path(path))
    return leftovers


def write_bytes_atomically(path: str | Path, data: bytes) -> None:
    """One file, all-or-nothing (:func:`atomic_file`)."""
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text_atomically(path: str | Path, text: str) -> None:
    write_bytes_atomically(path, text.encode())


def write_failure(err: BaseException) -> str | None:
    """The reason of a failed write ("No space left on device", "File too large"), or None when ``err`` is no write
    failure. safetensors reports its I/O errors as ``SafetensorError("... I/O error: <reason> (os error N)")``."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    text = str(err)
    if type(err).__name__ == "SafetensorError" and "I/O error: " in text:
        return text.split("I/O error: ", 1)[1].split(" (os error")[0]
    return None


# ----------------------------------------------------------------------------------------------------------------
# the swap
# ----------------------------------------------------------------------------------------------------------------

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, f"cannot swap {b} with its new content: {os.strerror(code)}", str(b))


def _manifest_names(staged: Path) -> set[str] | None:
    try:
        return set(json.loads((staged / MANIFEST).read_text()))
    except (OSError, ValueError):
        return None


def recover(target: str | Path) -> None:
    """Finish or undo an interrupted write into ``target`` and remove its leftovers (on the process that writes)."""
    target = Path(target).absolute()
    staged, old = staged_path(target), old_path(target)
    if not target.exists() and old.exists():
        if staged.is_dir() and _manifest_names(staged) is not None:
            os.replace(staged, target)  # killed between the two renames: the new content was complete
            logger.warning(f"Finished an interrupted save into {target}.")
        else:
            os.replace(old, target)
            logger.warning(f"Restored {target} after an interrupted save.")
    if staged.exists():
        listed = _manifest_names(staged)
        if listed is not None and target.is_dir():  # the swap had not happened: give carried entries back
            for entry in staged.iterdir():
                if entry.name not in listed and entry.name != MANIFEST and not (target / entry.name).exists():
                    os.replace(entry, target / entry.name)
        logger.warning(f"Removing {staged}, left by an interrupted save into {target}.")
        shutil.rmtree(staged)
    for leftover in (old, work_path(target)):
        if leftover.exists():
            shutil.rmtree(leftover)
    if (target / MANIFEST).exists():
        (target / MANIFEST).unlink()


def _carried(old: Path, new_names: set[str], replaced) -> list[Path]:
    return [e for e in old.iterdir() if e.name not in new_names and e.name != MANIFEST and not replaced(e.name)]


def link_or_copy(src: str, dst: str) -> str:
    """``dst`` as a hard link to the file ``src`` (a symbolic link stays one), or a copy where links are refused."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # a filesystem without hard links (or over its link limit): the bytes instead
        shutil.copy2(src, dst, follow_symlinks=False)
    return dst


def carry(entry: Path, dest: Path) -> None:
    """Give the staged content ``dest``: the old target's ``entry`` (a file or a whole directory), linked file by file;
    ``entry`` itself stays where it is, whole."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.copytree(entry, dest, symlinks=True, copy_function=link_or_copy)
        fsync_tree(dest)
    else:
        link_or_copy(str(entry), str(dest))


def swap_in(staged: Path, target: Path, replaced=lambda name: False) -> None:
    """Make ``staged`` (complete, not yet fsynced) the content of ``target``; see the module docstring.

    ``replaced(name)``: entries of the old ``target`` that the new content supersedes even when it has no file of
    that name (its weights); every other old entry the new content lacks is carried over.
    """
    fsync_tree(staged)
    new_names = {e.name for e in staged.iterdir()}
    write_text_atomically(staged / MANIFEST, json.dumps(sorted(new_names)))
    if target.is_dir():
        for entry in _carried(target, new_names, replaced):
            carry(entry, staged / entry.name)
        fsync_path(staged)
        if not _exchange(staged, target):
            old = old_path(target)
            os.replace(target, old)
            os.replace(staged, target)
        # the old content is at `staged` (exchange) or `old` (two renames)
        (target / MANIFEST).unlink()
        fsync_path(target)
        fsync_path(target.parent)
        for leftover in (staged, old_path(target)):
            if leftover.exists():
                shutil.rmtree(leftover)
    else:
        if target.exists() or target.is_symlink():
            raise FileExistsError(f"{target} exists and is not a directory; choose another output directory.")
        os.replace(staged, target)
        (target / MANIFEST).unlink()
        fsync_path(target)
        fsync_path(target.parent)


def replace_dir(tmp: str | Path, final: str | Path) -> None:
    """Make the complete directory ``tmp`` the directory ``final``: fsynced, then swapped in (an existing ``final``
    is exchanged atomically, or set aside as ``.<name>.hf-ext-old``, and removed afterwards)."""
    tmp, final = Path(tmp).absolute(), Path(final).absolute()
    fsync_tree(tmp)
    if final.exists() and _exchange(tmp, final):
        shutil.rmtree(tmp)
    else:
        old = old_path(final)
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        if old.exists():
            shutil.rmtree(old)
    fsync_path(final.parent)


def begin(target: str | Path) -> Path:
    """Recover ``target`` from an interrupted write, then create and return its empty staging directory."""
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    staged = staged_path(target)
    staged.mkdir()
    return staged


def commit(target: str | Path, replaced=lambda name: False) -> None:
    """Swap the staged content in (:func:`swap_in`); on a failure, put everything back as it was."""
    target = Path(target).absolute()
    try:
        swap_in(staged_path(target), target, replaced)
    except BaseException:
        recover(target)  # carried entries go back; the old content stays
        raise


def discard(target: str | Path) -> None:
    shutil.rmtree(staged_path(target), ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(target: str | Path, *, replaced=lambda name: False):
    """Write the content of ``target`` all-or-nothing (one process): yields the staging directory to write into and
    swaps it in when the block ends without an exception; on an exception ``target`` is untouched."""
    staged = begin(target)
    try:
        yield staged
    except BaseException:
        discard(target)
        raise
    commit(target, replaced)
