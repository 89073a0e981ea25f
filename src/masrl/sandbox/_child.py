"""Code that runs *inside* the sandboxed process (stdlib only, self-contained).

The harness starts ``python -I -S -B -c <this file's source> <json config>``. Importing this
module has no side effects: the harness imports it only for the value codec
(``encode_value`` / ``decode_value``), which both sides share.

Process tree inside one sandbox (see docs/sandbox.md)::

    B  supervisor   root, host PID namespace; unshares namespaces, sets up mounts, reports D's
    |               exit status on a pipe only it holds
    +- C  init      root, PID 1 of the new PID namespace; dies with B (PDEATHSIG), and when it
       |            exits the kernel kills everything left in the namespace
       +- D  runner  unprivileged uid, rlimits, no_new_privs: runs the candidate code

Without a PID namespace, B is D (no fork).
"""
from __future__ import annotations

import builtins
import os
import sys

# --------------------------------------------------------------------------------------
# value codec: plain data <-> JSON-able nodes. Scalars map to themselves; containers and
# special values are lists whose first item is a one-letter tag.
# --------------------------------------------------------------------------------------
MAX_DEPTH = 200
MAX_ITEMS = 2_000_000
_SMALL_INT = 2 ** 62


class CodecError(ValueError):
    """A value cannot be encoded, or a node is not a valid encoding."""


def encode_value(value, ref=None, *, max_items=MAX_ITEMS):
    """Encode ``value`` into JSON-able nodes.

    ``ref(obj)`` is called for objects that are not plain data; it returns a node (a
    reference to the object) or ``None`` to refuse, which raises ``CodecError``.
    """
    budget = [max_items]

    def seq(tag, items, depth):
        out = [tag]
        for x in items:
            out.append(enc(x, depth + 1))
        return out

    def enc(v, depth):
        budget[0] -= 1
        if budget[0] < 0:
            raise CodecError("value too large")
        if depth > MAX_DEPTH:
            raise CodecError("value too deeply nested")
        t = type(v)
        if v is None or t is bool or t is str:
            return v
        if t is int:
            return v if -_SMALL_INT < v < _SMALL_INT else ["H", format(v, "x")]
        if t is float:
            return v
        if t is list:
            return seq("L", v, depth)
        if t is tuple:
            return seq("T", v, depth)
        if t is dict:
            out = ["D"]
            for k, x in v.items():
                out.append(enc(k, depth + 1))
                out.append(enc(x, depth + 1))
            return out
        if t is set:
            return seq("S", v, depth)
        if t is frozenset:
            return seq("F", v, depth)
        if t is bytes:
            return ["B", v.hex()]
        if t is bytearray:
            return ["Y", bytes(v).hex()]
        if t is complex:
            return ["C", v.real, v.imag]
        if t is range:
            return ["G", enc(v.start, depth + 1), enc(v.stop, depth + 1), enc(v.step, depth + 1)]
        if t is type({}.keys()):
            return seq("K", v, depth)
        if t is type({}.values()):
            return seq("V", v, depth)
        if t is type({}.items()):
            out = ["W"]
            for k, x in v:
                out.append(enc(k, depth + 1))
                out.append(enc(x, depth + 1))
            return out
        # subclasses of plain types (namedtuple, OrderedDict, Counter, IntEnum, ...) are sent
        # as their base type, read through the base type's own slots
        if isinstance(v, int):
            return enc(int.__int__(v), depth)
        if isinstance(v, float):
            return enc(float.__float__(v), depth)
        if isinstance(v, str):
            return str.__str__(v)
        if isinstance(v, tuple):
            return seq("T", tuple.__iter__(v), depth)
        if isinstance(v, list):
            return seq("L", list.__iter__(v), depth)
        if isinstance(v, dict):
            out = ["D"]
            for k, x in dict.items(v):
                out.append(enc(k, depth + 1))
                out.append(enc(x, depth + 1))
            return out
        if isinstance(v, frozenset):
            return seq("F", frozenset.__iter__(v), depth)
        if isinstance(v, set):
            return seq("S", set.__iter__(v), depth)
        if isinstance(v, bytes):
            return ["B", bytes.hex(v)]
        if t is type and getattr(builtins, v.__name__, None) is v:  # int, str, list, ValueError ...
            return ["Q", v.__name__]
        # numpy scalars (np.int64, np.float32, np.bool_ ...) as the Python scalar
        if getattr(t, "__module__", "") == "numpy" and getattr(v, "shape", None) == () and hasattr(v, "item"):
            return enc(v.item(), depth)
        if ref is not None:
            node = ref(v)
            if node is not None:
                return node
        raise CodecError(f"cannot encode a value of type {t.__name__}")

    return enc(value, 0)


def encode_iterator(it, ref=None, *, max_items=100_000):
    """Consume an iterator (generator, map, filter, ...) into an ``I`` node."""
    items = []
    for x in it:
        items.append(x)
        if len(items) > max_items:
            raise CodecError(f"iterator yields more than {max_items} items")
    return ["I"] + [encode_value(x, ref) for x in items]


def decode_value(node, ref=None, *, max_depth=MAX_DEPTH):
    """Inverse of ``encode_value``; ``ref(node)`` resolves ``R``/``N`` nodes.

    Never executes code from the data; raises ``CodecError`` on malformed input.
    """

    def items(n, depth):
        return [dec(x, depth + 1) for x in n[1:]]

    def hashed(keys):
        # crafted keys with equal hashes (ints/floats/tuples hash deterministically) would make
        # building a set/dict quadratic: refuse heavy collisions
        if len(keys) > 256:
            counts = {}
            for k in keys:
                h = hash(k)
                counts[h] = counts.get(h, 0) + 1
                if counts[h] > 64:
                    raise CodecError("too many hash collisions")
        return keys

    def pairs(n, depth):
        flat = n[1:]
        if len(flat) % 2:
            raise CodecError("odd number of items in a mapping node")
        return [(dec(flat[i], depth + 1), dec(flat[i + 1], depth + 1)) for i in range(0, len(flat), 2)]

    def dec(n, depth):
        if depth > max_depth:
            raise CodecError("value too deeply nested")
        t = type(n)
        if n is None or t is bool or t is str or t is int or t is float:
            return n
        if t is not list or not n or type(n[0]) is not str:
            raise CodecError(f"invalid node {type(n).__name__}")
        tag = n[0]
        try:
            if tag == "L":
                return items(n, depth)
            if tag == "T":
                return tuple(items(n, depth))
            if tag == "D":
                p = pairs(n, depth)
                hashed([k for k, _ in p])
                return dict(p)
            if tag == "S":
                return set(hashed(items(n, depth)))
            if tag == "F":
                return frozenset(hashed(items(n, depth)))
            if tag == "I":
                return iter(items(n, depth))
            if tag == "K":
                return dict.fromkeys(hashed(items(n, depth))).keys()
            if tag == "V":
                return dict(enumerate(items(n, depth))).values()
            if tag == "W":
                p = pairs(n, depth)
                hashed([k for k, _ in p])
                return dict(p).items()
            if tag == "H" and len(n) == 2 and type(n[1]) is str and len(n[1]) < 1_000_000:
                return int(n[1], 16)
            if tag == "B" and len(n) == 2 and type(n[1]) is str:
                return bytes.fromhex(n[1])
            if tag == "Y" and len(n) == 2 and type(n[1]) is str:
                return bytearray.fromhex(n[1])
            if tag == "C" and len(n) == 3 and all(type(x) in (int, float) for x in n[1:]):
                return complex(n[1], n[2])
            if tag == "G" and len(n) == 4:
                a, b, c = (dec(x, depth + 1) for x in n[1:])
                if not all(type(x) is int for x in (a, b, c)):
                    raise CodecError("range bounds must be ints")
                r = range(a, b, c)
                if len(r) > MAX_ITEMS:  # the judge might materialise it
                    raise CodecError("range too long")
                return r
            if tag == "Q" and len(n) == 2 and type(n[1]) is str:
                v = getattr(builtins, n[1], None)
                if type(v) is type:
                    return v
            if tag in ("R", "N") and ref is not None and len(n) == 2:
                return ref(n)
        except CodecError:
            raise
        except (TypeError, ValueError, OverflowError) as e:  # unhashable keys, bad hex, ...
            raise CodecError(f"invalid {tag!r} node: {e}") from None
        raise CodecError(f"invalid node tag {tag!r}")

    return dec(node, 0)


# --------------------------------------------------------------------------------------
# framing on the request/response pipes: 4-byte big-endian length + UTF-8 JSON
# --------------------------------------------------------------------------------------
def _read_exact(fd, n):
    chunks = []
    while n:
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _read_request(fd):
    """Requests come from the (trusted) harness, marshalled."""
    import marshal

    head = _read_exact(fd, 4)
    if head is None:
        return None
    body = _read_exact(fd, int.from_bytes(head, "big"))
    return None if body is None else marshal.loads(body)


_JSON_ESCAPES = {i: "\\u%04x" % i for i in range(32)}
_JSON_ESCAPES[ord('"')] = '\\"'
_JSON_ESCAPES[ord("\\")] = "\\\\"


def to_json(obj):
    """JSON text of a response (dicts with str keys, lists, str, int, float, bool, None).

    Hand-written so the child does not import ``json`` (and ``re``): saves ~25 ms per start.
    Lone surrogates are kept; the harness decodes the bytes with ``surrogatepass``.
    """
    out = []
    put = out.append

    def w(v, depth):
        if depth > 2 * MAX_DEPTH + 8:
            raise CodecError("value too deeply nested")
        t = type(v)
        if t is str:
            put('"' + v.translate(_JSON_ESCAPES) + '"')
        elif v is None:
            put("null")
        elif v is True:
            put("true")
        elif v is False:
            put("false")
        elif t is int:
            put(int.__repr__(v))
        elif t is float:
            if v != v:
                put("NaN")
            elif v in (float("inf"), float("-inf")):
                put("Infinity" if v > 0 else "-Infinity")
            else:
                put(float.__repr__(v))
        elif t is list:
            put("[")
            for i, x in enumerate(v):
                if i:
                    put(",")
                w(x, depth + 1)
            put("]")
        elif t is dict:
            put("{")
            for i, (k, x) in enumerate(v.items()):
                if i:
                    put(",")
                w(str(k), depth + 1)
                put(":")
                w(x, depth + 1)
            put("}")
        else:
            raise CodecError(f"cannot serialise {t.__name__}")

    w(obj, 0)
    return "".join(out)


def _write_frame(fd, obj):
    data = to_json(obj).encode("utf-8", "surrogatepass")
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


# --------------------------------------------------------------------------------------
# isolation set-up (Linux)
# --------------------------------------------------------------------------------------
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 0x4000, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 1, 2, 4, 8
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # same number on every architecture (new-style syscall table)
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38

_libc = None


def _c():
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(ret, what):
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags):
    _check(_c().unshare(flags), "unshare")


def _mount(src, target, fstype, flags, data=None):
    import ctypes

    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_c().mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _mount_setattr(path, attr_set, attr_clr, recursive):
    import ctypes

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(attr_set, attr_clr, 0, 0)
    ret = _c().syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(),
                       ctypes.c_uint(AT_RECURSIVE if recursive else 0), ctypes.byref(attr),
                       ctypes.c_size_t(ctypes.sizeof(attr)))
    _check(ret, f"mount_setattr {path}")


def _prctl(option, arg):
    import ctypes

    _check(_c().prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)), f"prctl {option}")


def _drop_capabilities():
    """Empty the effective/permitted/inheritable capability sets (user-namespace mode)."""
    import ctypes

    nr = SYS_CAPSET.get(os.uname().machine)
    if nr is None:
        raise OSError("capset: unknown syscall number for this architecture")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    _check(_c().syscall(ctypes.c_long(nr), header, data), "capset")


def _unshare_with_helper(flags, maps):
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    me = os.getpid()
    helper = os.fork()
    if helper == 0:
        code = 1
        try:
            os.close(go_w)
            os.close(done_r)
            if os.read(go_r, 1) == b"1":
                for name, text in maps:
                    with open(f"/proc/{me}/{name}", "w") as f:
                        f.write(text)
                os.write(done_w, b"1")
                code = 0
        finally:
            os._exit(code)
    os.close(go_r)
    os.close(done_w)
    try:
        _unshare(flags)
        os.write(go_w, b"1")
    finally:
        os.close(go_w)
    ok = os.read(done_r, 1) == b"1"
    os.close(done_r)
    os.waitpid(helper, 0)
    if not ok:
        raise OSError("could not write the user namespace id maps")


def _is_under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


def _open_exposed(cfg):
    """O_PATH handles of the directories re-exposed after hiding (taken before unsharing, while
    every path is still reachable)."""
    return [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in cfg["expose"] + [cfg["workdir"]]]


def _setup_mounts(cfg, keep):
    """Read-only view of the host file system: hidden paths become empty, the Python install
    stays visible, no pseudo-terminals, a private /dev/shm, and the work directory is the only
    other writable place: a fresh tmpfs of bounded size and inode count that vanishes with the
    mount namespace."""
    workdir = cfg["workdir"]
    handles = dict(keep)
    script = _read_script(handles.get(workdir))
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    hidden = []
    for h in cfg["hide"]:
        if not os.path.isdir(h) or os.path.islink(h) or any(_is_under(h, x) for x in hidden):
            continue
        _mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=755")
        hidden.append(h)
    for p, fd in keep:
        if p != workdir and any(_is_under(p, h) for h in hidden):
            os.makedirs(p, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    shm = os.path.isdir("/dev/shm")
    if shm:
        _mount("tmpfs", "/dev/shm", "tmpfs", flags, "size=16m,nr_inodes=1024,mode=1777")
    # host pseudo-terminals: /dev/ptmx opens /dev/null, /dev/pts is empty
    if os.path.exists("/dev/ptmx"):
        _mount("/dev/null", "/dev/ptmx", None, MS_BIND)
    if os.path.isdir("/dev/pts"):
        _mount("tmpfs", "/dev/pts", "tmpfs", flags, "size=4k,nr_inodes=16,mode=755")
    # the work dir's path exists in this view (it may lie under a hidden directory or /dev/shm)
    os.makedirs(workdir, exist_ok=True)
    _mount(f"/proc/self/fd/{handles[workdir]}", workdir, None, MS_BIND)
    for _, fd in keep:
        os.close(fd)
    # not NODEV: /dev/null, /dev/urandom must keep working (device files ignore read-only mounts)
    try:
        _mount_setattr("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, True)
        if shm:
            _mount_setattr("/dev/shm", 0, MOUNT_ATTR_RDONLY, False)
    except OSError:  # kernels before 5.12: remount every mount point read-only
        _remount_all_readonly()
        if shm:
            _mount(None, "/dev/shm", None, MS_REMOUNT | MS_BIND | flags)
    lim = cfg["limits"]
    owner = 0 if cfg["iso"].get("userns") else cfg["iso"].get("uid")
    opts = f"size={max(1, int(lim['disk_bytes']) >> 10)}k,nr_inodes={max(16, int(lim['inodes']))},mode=700"
    if owner is not None:
        opts += f",uid={owner},gid={owner}"
    _mount("tmpfs", workdir, "tmpfs", flags, opts)
    if script is not None:
        fd = os.open(os.path.join(workdir, "main.py"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            while script:
                script = script[os.write(fd, script):]
            if owner is not None:
                os.fchown(fd, owner, owner)
        finally:
            os.close(fd)


def _read_script(dir_fd):
    """The program file the harness wrote into the (host) work directory, if any."""
    if dir_fd is None:
        return None
    try:
        fd = os.open("main.py", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def _remount_all_readonly():
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for mp in sorted(set(points), key=len):
        mp = mp.replace("\\040", " ")
        try:
            _mount(None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
        except OSError:
            pass


def _limit_ipc(lim, required):
    """SysV IPC limits of the new IPC namespace (its memory is not counted by RLIMIT_AS). Older
    kernels refuse these writes inside a user namespace: then only the seccomp filter (which
    refuses shmget/msgget altogether) holds, and without it the set-up fails."""
    page = os.sysconf("SC_PAGE_SIZE")
    shm = int(lim.get("shm_bytes", 16 << 20))
    for name, value in (("shmmax", shm), ("shmall", max(1, shm // page)), ("shmmni", 16),
                        ("msgmni", 4), ("msgmnb", 16384), ("msgmax", 8192)):
        try:
            with open(f"/proc/sys/kernel/{name}", "w") as f:
                f.write(str(value))
        except OSError:
            if required:
                raise


def _fresh_session_keyring():
    """Join a new anonymous session keyring: no possessor rights on the harness's keys, and
    keys the program adds die with it."""
    import ctypes

    nr = SYS_KEYCTL.get(os.uname().machine)
    if nr is None:
        raise OSError("keyctl: unknown syscall number for this architecture")
    ret = _c().syscall(ctypes.c_long(nr), ctypes.c_long(1), ctypes.c_void_p(None))  # KEYCTL_JOIN_SESSION_KEYRING
    if ret < 0:
        err = ctypes.get_errno()
        # ENOSYS: a kernel without keys; EPERM: keyctl is filtered for everyone here (e.g. a
        # container's seccomp profile), the program cannot reach any keyring either
        if err not in (1, 38):
            raise OSError(err, f"keyctl(JOIN_SESSION_KEYRING): {os.strerror(err)}")


# system calls refused to the candidate (seccomp): memory outside RLIMIT_AS (memfd, SysV shm
# and message queues), keyrings, namespaces and mounts, io_uring, eBPF, perf, userfaultfd
_DENY_NAMES = ("memfd_create", "memfd_secret", "shmget", "msgget", "semget", "keyctl", "add_key", "request_key", "unshare",
               "setns", "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "open_tree",
               "move_mount", "mount_setattr", "io_uring_setup", "io_uring_enter", "io_uring_register",
               "userfaultfd", "bpf", "perf_event_open")
_SYSCALLS = {
    "x86_64": dict(arch=0xC000003E, clone=56, clone3=435, memfd_create=319, memfd_secret=447, shmget=29, msgget=68, semget=64,
                   keyctl=250, add_key=248, request_key=249, unshare=272, setns=308, mount=165, umount2=166,
                   pivot_root=155, fsopen=430, fsconfig=431, fsmount=432, fspick=433, open_tree=428,
                   move_mount=429, mount_setattr=442, io_uring_setup=425, io_uring_enter=426,
                   io_uring_register=427, userfaultfd=323, bpf=321, perf_event_open=298),
    "aarch64": dict(arch=0xC00000B7, clone=220, clone3=435, memfd_create=279, memfd_secret=447, shmget=194,
                    msgget=186, semget=190, keyctl=219, add_key=217, request_key=218, unshare=97, setns=268, mount=40,
                    umount2=39, pivot_root=41, fsopen=430, fsconfig=431, fsmount=432, fspick=433, open_tree=428,
                    move_mount=429, mount_setattr=442, io_uring_setup=425, io_uring_enter=426,
                    io_uring_register=427, userfaultfd=282, bpf=280, perf_event_open=241),
}
CLONE_NEW_MASK = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET


def _install_seccomp():
    """A seccomp filter (raw BPF through ctypes; needs NO_NEW_PRIVS) refusing _DENY_NAMES with
    EPERM, clone() with namespace flags, clone3 (ENOSYS: libc falls back to clone) and every
    system call of another ABI (x32, i386)."""
    import ctypes

    table = _SYSCALLS.get(os.uname().machine)
    if table is None:
        raise OSError("seccomp: no system call table for this architecture")
    eperm, enosys, allow = 0x00050000 | 1, 0x00050000 | 38, 0x7FFF0000
    ins = [(0x20, 0, 0, 4), (0x15, 1, 0, table["arch"]), (0x06, 0, 0, enosys), (0x20, 0, 0, 0)]
    if os.uname().machine == "x86_64":
        ins += [(0x35, 0, 1, 0x40000000), (0x06, 0, 0, enosys)]  # x32 system calls
    for name in _DENY_NAMES:
        ins += [(0x15, 0, 1, table[name]), (0x06, 0, 0, eperm)]
    ins += [(0x15, 0, 1, table["clone3"]), (0x06, 0, 0, enosys),
            (0x15, 0, 3, table["clone"]), (0x20, 0, 0, 16), (0x45, 0, 1, CLONE_NEW_MASK), (0x06, 0, 0, eperm),
            (0x06, 0, 0, allow)]

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    prog_ins = (SockFilter * len(ins))(*[SockFilter(*i) for i in ins])
    prog = SockFprog(len(ins), prog_ins)
    _check(_c().prctl(ctypes.c_int(22), ctypes.c_ulong(2), ctypes.byref(prog), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)), "prctl(PR_SET_SECCOMP)")


def _set_rlimits(lim):
    import resource

    def setl(which, value):
        if value is None:
            return
        value = int(value)
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value if which != resource.RLIMIT_CPU else value + 1))

    setl(resource.RLIMIT_CORE, 0)
    setl(resource.RLIMIT_CPU, lim.get("cpu_s"))
    setl(resource.RLIMIT_AS, lim.get("memory_bytes"))
    setl(resource.RLIMIT_FSIZE, lim.get("file_bytes"))
    setl(resource.RLIMIT_NOFILE, lim.get("nofile"))
    setl(resource.RLIMIT_NPROC, lim.get("nproc"))
    setl(resource.RLIMIT_MSGQUEUE, 0)


# --------------------------------------------------------------------------------------
# fallback guard (no namespaces): an audit hook. Stops accidents and naive attacks only;
# audit hooks are not a security boundary (PEP 578).
# --------------------------------------------------------------------------------------
def _install_guard(workdir, read_roots, allow_network, allow_fork):
    realpath = os.path.realpath
    fspath = os.fsdecode
    wd = realpath(workdir)
    writable = (wd, "/dev/null")
    readable = tuple(realpath(r) for r in read_roots) + (wd, "/dev/null", "/dev/urandom", "/dev/random",
                                                       "/dev/zero", f"/proc/{os.getpid()}")
    getpid, getpgrp = os.getpid, os.getpgrp
    under = _is_under
    write_events = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.utime", "os.truncate",
                    "os.chflags", "os.setxattr", "os.removexattr", "shutil.rmtree", "shutil.copyfile",
                    "shutil.copymode", "shutil.copystat", "shutil.move", "shutil.make_archive",
                    "shutil.unpack_archive"}
    always_blocked = ("os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
                      "os.startfile", "pty.spawn", "ctypes.", "gc.get_objects", "gc.get_referrers",
                      "gc.get_referents", "os.symlink", "os.link", "sys.remote_exec", "os.forkpty",
                      "mmap.__new__", "_posixsubprocess")
    blocked = always_blocked + (() if allow_network else ("socket.",)) + (() if allow_fork else ("os.fork",))

    def resolve(p):
        try:
            if isinstance(p, int):
                return None
            return realpath(fspath(p))
        except Exception:
            return "/"

    def check_write(p):
        r = resolve(p)
        if r is not None and not any(under(r, w) for w in writable):
            raise PermissionError(f"sandbox: writing {p!r} is not allowed")

    # no audit event covers these: host pseudo-terminals and POSIX shared memory (/dev/shm)
    import posix

    for name in ("openpty", "forkpty", "login_tty"):
        for mod in (os, posix):
            if hasattr(mod, name):
                delattr(mod, name)
    blocked_modules = ("_posixshmem",)

    def hook(event, args):
        if event.startswith(blocked):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args and args[0] in blocked_modules:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            r = resolve(path)
            if r is None:
                return
            wants_write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            if wants_write:
                check_write(path)
            elif not any(under(r, x) for x in readable):
                raise PermissionError(f"sandbox: reading {path!r} is not allowed")
        elif event in write_events:
            if args:
                check_write(args[0])
            if event in ("shutil.copyfile", "shutil.move") and len(args) > 1:
                check_write(args[1])
        elif event in ("os.rename",):
            check_write(args[0])
            check_write(args[1])
        elif event in ("os.listdir", "os.scandir"):
            r = resolve(args[0] if args and args[0] is not None else ".")
            if r is not None and not any(under(r, x) for x in readable):
                raise PermissionError(f"sandbox: listing {args[0]!r} is not allowed")
        elif event == "os.kill":
            if args[0] not in (getpid(), 0):
                raise PermissionError("sandbox: signalling other processes is not allowed")
        elif event == "os.killpg":
            if args[0] != getpgrp():
                raise PermissionError("sandbox: signalling other process groups is not allowed")
        elif event == "signal.pthread_kill":
            pass
        elif event == "object.__setattr__" and len(args) > 1 and args[1] in ("__code__", "__closure__"):
            raise PermissionError("sandbox: rebinding code objects is not allowed")

    sys.addaudithook(hook)


# --------------------------------------------------------------------------------------
# the runner (process D): privileges, limits, then the candidate
# --------------------------------------------------------------------------------------
def _become_candidate(cfg):
    iso = cfg["iso"]
    if iso.get("userns"):
        # uid/gid 0 inside the namespace are the (unprivileged) host ids from uid_map/gid_map;
        # then give up every capability the namespace granted
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        _drop_capabilities()
    elif iso.get("uid") is not None:
        gid = iso["gid"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(iso["uid"], iso["uid"], iso["uid"])
    if iso.get("no_new_privs", True):
        try:
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
            _prctl(PR_SET_DUMPABLE, 1)
        except OSError:
            pass
    if not iso.get("pidns"):
        try:  # B is D here: the uid change cleared the parent-death signal
            _die_with_harness(cfg)
        except OSError:
            pass
    _set_rlimits(cfg["limits"])
    if cfg.get("keyring"):
        _fresh_session_keyring()
    if cfg.get("seccomp"):
        _install_seccomp()
    os.chdir(cfg["workdir"])
    if iso.get("guard"):
        _install_guard(cfg["workdir"], cfg["read_roots"], cfg["network"], iso.get("allow_fork", False))


def _run_script(cfg):
    path = os.path.join(cfg["workdir"], "main.py")
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        src = f.read()
    mod = type(sys)("__main__")
    mod.__file__ = path
    mod.__builtins__ = __builtins__
    sys.modules["__main__"] = mod
    sys.argv = [path]
    code = 0
    try:
        exec(compile(src, path, "exec"), mod.__dict__)
    except SystemExit as e:
        c = e.code
        if c is None:
            code = 0
        elif isinstance(c, int):
            code = c & 0xFF
        else:
            try:
                print(c, file=sys.stderr)
            except Exception:
                pass
            code = 1
    except BaseException:
        try:
            import traceback

            traceback.print_exc()
        except BaseException:
            pass
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)


def _exc_info(e):
    try:
        msg = str(e)[:2000]
    except BaseException:
        msg = "<unprintable>"
    return [type(e).__name__, msg]


def _serve(cfg):
    """RPC loop: load the candidate program, then answer call/getattr requests."""
    req_fd, resp_fd = cfg["req_fd"], cfg["resp_fd"]
    mod = type(sys)("__candidate__")
    mod.__builtins__ = __builtins__
    sys.modules["__candidate__"] = mod
    handles = {}
    ids = {}

    def make_ref(obj):
        key = id(obj)
        if key not in ids:
            ids[key] = len(handles) + 1
            handles[ids[key]] = obj
        return ["R", ids[key]]

    def resolve(node):
        if node[0] == "R":
            obj = handles.get(node[1], handles)
            if obj is handles:
                raise KeyError(f"unknown handle {node[1]!r}")
            return obj
        name = node[1]
        g = mod.__dict__
        if name in g:
            return g[name]
        b = g.get("__builtins__")
        b = b if isinstance(b, dict) else getattr(b, "__dict__", {})
        if name in b:
            return b[name]
        raise NameError(f"name {name!r} is not defined")

    def encode_result(v):
        if hasattr(type(v), "__next__") and not isinstance(v, (str, bytes)):
            return encode_iterator(v, make_ref)
        return encode_value(v, make_ref)

    _write_frame(resp_fd, {"seq": -1, "hello": True})  # before any candidate code runs
    while True:
        try:
            msg = _read_request(req_fd)
        except Exception:
            os._exit(3)
        if msg is None:
            os._exit(0)
        seq = msg.get("seq")
        out = {"seq": seq}
        try:
            op = msg["op"]
            if op == "load":
                out["phase"] = "compile"
                code = compile(msg["code"], msg.get("filename", "<candidate>"), "exec")
                out["phase"] = "run"
                exec(code, mod.__dict__)
                if msg.get("setup"):
                    out["phase"] = "setup"
                    exec(compile(msg["setup"], "<setup>", "exec"), mod.__dict__)
                out["ok"] = True
            elif op == "call":
                target = decode_value(msg["target"], resolve)
                args = decode_value(msg["args"], resolve)
                kwargs = decode_value(msg["kwargs"], resolve)
                result = target(*args, **kwargs)
                out["value"] = encode_result(result)
                after = []
                for i, (node, a) in enumerate(zip(msg["args"][1:], args)):
                    if type(a) in (list, dict, set, bytearray):
                        try:
                            enc = encode_value(a, make_ref)
                        except CodecError:
                            continue
                        if enc != node:
                            after.append([i, enc])
                if after:
                    out["after"] = after
            elif op == "getattr":
                target = decode_value(msg["target"], resolve)
                out["value"] = encode_result(getattr(target, msg["name"]))
            elif op == "ping":
                out["ok"] = True
            else:
                raise ValueError(f"unknown op {op!r}")
        except CodecError as e:
            out = {"seq": seq, "raise": ["UnencodableValue", str(e)]}
        except BaseException as e:  # SystemExit / KeyboardInterrupt raised by the candidate too
            phase = out.get("phase")
            out = {"seq": seq, "raise": _exc_info(e)}
            if phase:
                out["phase"] = phase
        try:
            _write_frame(resp_fd, out)
        except (CodecError, TypeError, ValueError) as e:
            _write_frame(resp_fd, {"seq": seq, "raise": ["UnencodableValue", str(e)]})


def _runner(cfg):
    try:
        _become_candidate(cfg)
        # the harness counts the sandbox as set up only after this byte: nothing the
        # candidate does later can make its failure look like a set-up failure
        os.write(cfg["ready_fd"], b"1")
        os.close(cfg["ready_fd"])
    except BaseException as e:
        try:
            os.write(2, f"masrl-sandbox: setup failed in runner: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(126)
    if cfg["mode"] == "serve":
        _serve(cfg)
    else:
        _run_script(cfg)
    os._exit(0)


def _report(fd, obj):
    try:
        os.write(fd, (to_json(obj) + "\n").encode("utf-8", "replace"))
    except (OSError, CodecError):
        pass


def _die_with_harness(cfg):
    """SIGKILL this process when the harness dies (re-armed after every credential change,
    which clears it); the harness may have died already."""
    _prctl(PR_SET_PDEATHSIG, 9)
    if os.getppid() != cfg["harness_pid"]:
        os._exit(1)


def main(cfg):
    iso = cfg["iso"]
    status_fd = cfg.get("status_fd")
    try:
        for path in cfg.get("cgroups") or ():  # first: everything below is counted
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        if iso.get("pidns") or iso.get("mntns") or iso.get("userns"):
            _die_with_harness(cfg)
        flags = 0
        if iso.get("userns"):
            flags |= CLONE_NEWUSER
        if iso.get("mntns"):
            flags |= CLONE_NEWNS
        if iso.get("netns") and not cfg["network"]:
            flags |= CLONE_NEWNET
        if iso.get("pidns"):
            flags |= CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        if flags:
            # inside a user namespace, uid 0 maps to a fresh unprivileged uid when we are root,
            # else to our own uid (the only mapping an unprivileged process may write)
            map_uid = iso["uid"] if iso.get("uid") is not None else os.getuid()
            map_gid = iso["gid"] if iso.get("gid") is not None else os.getgid()
            maps = [("uid_map", f"0 {map_uid} 1"), ("gid_map", f"0 {map_gid} 1")]
            if iso.get("userns") and map_uid != os.geteuid():
                # mapping another uid than our own needs CAP_SETUID in the *parent* namespace,
                # which we lose by unsharing: a helper left outside writes the maps
                os.setgroups([])  # supplementary groups would survive into the namespace
                _unshare_with_helper(flags, maps)
            else:
                _unshare(flags)
                if iso.get("userns"):
                    for name, text in [("setgroups", "deny")] + maps:
                        with open(f"/proc/self/{name}", "w") as f:
                            f.write(text)
            # handles on the re-exposed directories: taken in the new mount namespace (bind
            # mounts cannot cross namespaces) but before becoming the user namespace's root
            # (its host uid could not traverse e.g. a 0700 /root to reach them)
            keep = _open_exposed(cfg) if iso.get("mntns") else []
            if iso.get("userns"):
                os.setresgid(0, 0, 0)  # become the namespace's root (keeps its capabilities)
                os.setresuid(0, 0, 0)
                _die_with_harness(cfg)
        if flags & CLONE_NEWIPC:
            _limit_ipc(cfg["limits"], required=not cfg.get("seccomp"))
        if iso.get("mntns"):
            _setup_mounts(cfg, keep)
    except BaseException as e:
        if status_fd is not None:
            _report(status_fd, {"setup_error": f"{type(e).__name__}: {e}"})
        os.write(2, f"masrl-sandbox: setup failed: {type(e).__name__}: {e}\n".encode())
        os._exit(125)

    if not iso.get("pidns"):
        if status_fd is not None:
            os.close(status_fd)
        _runner(cfg)  # B is D

    # B: fork C, the init of the new PID namespace
    rel_r, rel_w = os.pipe()  # C -> B: D's wait status
    alive_r, alive_w = os.pipe()  # held by B only: EOF tells C that B is gone
    c_pid = os.fork()
    if c_pid == 0:
        try:
            os.close(rel_r)
            os.close(alive_w)
            if status_fd is not None:
                os.close(status_fd)
            _prctl(PR_SET_PDEATHSIG, 9)
            import select

            if select.select([alive_r], [], [], 0)[0]:
                os._exit(1)  # B died before PDEATHSIG was armed
            if iso.get("mntns"):
                try:
                    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                except OSError:
                    pass  # keep the host /proc (read-only); documented
            d_pid = os.fork()
            if d_pid == 0:
                os.close(rel_w)
                os.close(alive_r)
                _runner(cfg)
            os.close(cfg["ready_fd"])
            while True:
                try:
                    pid, st = os.waitpid(-1, 0)
                except ChildProcessError:
                    os._exit(4)
                except InterruptedError:
                    continue
                if pid == d_pid:
                    os.write(rel_w, str(st).encode())
                    os._exit(0)
        except BaseException as e:
            os.write(2, f"masrl-sandbox: init failed: {type(e).__name__}: {e}\n".encode())
            os._exit(124)
    os.close(rel_w)
    os.close(alive_r)
    os.close(cfg["ready_fd"])
    if status_fd is not None:
        _report(status_fd, {"init_pid": c_pid})  # the harness stops the sandbox by killing C
    # B must not hold the candidate's pipes open: the harness waits for EOF on them
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    for fd in (cfg.get("req_fd"), cfg.get("resp_fd")):
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    while True:
        try:
            _, c_status = os.waitpid(c_pid, 0)
            break
        except InterruptedError:
            continue
    data = b""
    while True:
        chunk = os.read(rel_r, 64)
        if not chunk:
            break
        data += chunk
    d_status = int(data) if data.strip().isdigit() else None
    if status_fd is not None:
        _report(status_fd, {"wstatus": d_status, "init_status": c_status})
    os._exit(0)

