"""The per-user secret that signs what kbench keeps on disk: CUBINs (NVRTC's file cache and the
kernel cache's winners) and captured models. Whoever can write a cache file (a shared folder, a
cache copied from elsewhere) cannot sign it, so what they wrote is recompiled or captured again,
never loaded. The key is `kbench.key` in the cache folder: 32 random bytes, mode 0600, trusted
only while it is a regular file owned by this user that nobody else can read or write."""
from __future__ import annotations

import hashlib
import hmac
import os
import stat
import warnings

KEY_NAME = "kbench.key"
KEY_BYTES = 32


def cache_root() -> str:
    """$KBENCH_CACHE_DIR, else ~/.cache/kbench: the folder of kbench.sqlite, cubin/ and the key."""
    return os.environ.get("KBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kbench")


def load(root: str | None = None, *, create: bool = True) -> tuple[bytes | None, str]:
    """(key, "") for the cache folder root (default cache_root()), made on first use where
    create; else (None, why): nothing kept on disk is then trusted, and nothing is signed."""
    path = os.path.join(root or cache_root(), KEY_NAME)
    for _ in range(3):   # a file being made by another process is retried
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            if not create:
                return None, f"no key file {path}"
            why = _create(path)
            if why:
                return None, why
            continue
        except OSError as e:   # a symlink (ELOOP), unreadable
            return None, f"key file {path} cannot be opened ({e.strerror or e})"
        try:
            st = os.fstat(fd)
            data = os.read(fd, KEY_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
        except OSError as e:
            return None, f"key file {path} cannot be read ({e.strerror or e})"
        finally:
            os.close(fd)
        why = _untrusted(st, len(data))
        return (None, f"key file {path} {why}") if why else (data, "")
    return None, f"key file {path} keeps vanishing"


def _untrusted(st, size: int) -> str:
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return "belongs to another user"
    if st.st_mode & 0o077:
        return f"is readable or writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    if size != KEY_BYTES:
        return f"holds {size} bytes, not {KEY_BYTES}"
    return ""


def _create(path: str) -> str:
    """A new key at path, or why not. Written to a private temporary file and linked into place,
    so another process never reads half a key, and two that race keep the first one's."""
    folder = os.path.dirname(path)
    tmp = f"{path}.tmp.{os.getpid()}.{os.urandom(4).hex()}"
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as e:
        return f"cannot create the key file {path} ({e.strerror or e})"
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
        os.link(tmp, path)
    except FileExistsError:
        pass   # another process made it first: its key is read on the next pass
    except OSError as e:
        return f"cannot create the key file {path} ({e.strerror or e})"
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return ""


_warned: set = set()


def warn_once(why: str) -> None:
    """One warning per reason per process: caches are opened many times per optimize()."""
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"kbench: {why}; CUBINs and captures cached on disk are neither trusted nor signed "
                      f"(a key file that is not trusted can be deleted: a new one is made)", RuntimeWarning,
                      stacklevel=3)


def sign(key: bytes, *parts) -> str:
    """HMAC-SHA256 (hex) of parts (bytes, str or None), each length-prefixed so that no two
    different lists of parts sign alike."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        if p is None:
            h.update(b"\xff" * 8)
            continue
        b = p.encode() if isinstance(p, str) else bytes(p)
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def verify(key: bytes | None, mac, *parts) -> bool:
    """Whether mac is sign(key, *parts); False without a key or a mac."""
    if key is None or not isinstance(mac, str):
        return False
    return hmac.compare_digest(mac, sign(key, *parts))
