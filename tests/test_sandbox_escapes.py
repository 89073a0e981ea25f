"""Sandbox escapes an outside probe found, as adversarial tests.

Cleanup that never raises, never recurses and is bounded in time; a reward function that
raises never takes a training step down; HumanEval asserts inside loops; a fresh session
keyring; memory the kernel holds outside RLIMIT_AS (memfd, SysV shm); forged oversized replies;
host pseudo-terminals; lone surrogates in a program. Each runs under every isolation level that
works here and stays fast.
"""
from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest
from conftest import FAST_TMP, cached_sandbox

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

if sys.platform == "linux":
    from masrl.sandbox import Limits, Sandbox, SandboxError, _cleanup, run_python
    from masrl.codecheck.scoring import score_code
    from masrl.types import Task

MODES = ["namespaces", "userns", "basic"]
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _sandbox(mode: str, **kwargs) -> "Sandbox":
    return cached_sandbox(mode, own_tmp=True, **kwargs)


@pytest.fixture(params=MODES)
def sb(request):
    return _sandbox(request.param)


def _leftover_workdirs(sb) -> list[str]:
    _cleanup.finish_pending(30)
    return [p.name for p in Path(sb.tmp_root).glob("masrl-sbx-*")]


# ----------------------------------------------------------------------------------------
# 1. cleanup: never raises, never recurses, bounded; a failing reward is a zero reward
# ----------------------------------------------------------------------------------------
DEEP_CHAIN = textwrap.dedent("""
    import os
    for i in range(2000):
        os.mkdir("d")
        os.chdir("d")
    open("leaf", "w").write("x")
    os.chmod(".", 0)          # an unreadable directory at the bottom
    print("deep")
""")


def test_deep_directory_chain_is_removed(sb):
    t0 = time.monotonic()
    res = run_python(DEEP_CHAIN, timeout_s=20, sandbox=sb)  # raised RecursionError before
    assert res.status == "ok" and res.stdout == "deep\n", res.stderr[-500:]
    assert time.monotonic() - t0 < res.duration_s + 3.0
    assert _leftover_workdirs(sb) == []


def test_inode_flood_cleanup_is_bounded(sb):
    flood = ("import os, time\nend = time.time() + 30\ni = 0\n"
             "while time.time() < end:\n"
             "    try:\n        open(str(i), 'w').close()\n    except OSError:\n        pass\n    i += 1\n")
    t0 = time.monotonic()
    res = run_python(flood, timeout_s=1.0, sandbox=sb)
    spent = time.monotonic() - t0
    assert res.status == "timeout"
    # kill + at most the cleanup budget (1 s) on the caller's thread; the rest in the background
    assert spent < 1.0 + 2.5, spent
    assert _leftover_workdirs(sb) == []


def test_remove_tree_never_recurses_follows_links_or_raises(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="masrl-test-rm-", dir=FAST_TMP))
    outside = tmp_path / "keep"
    outside.mkdir()
    (outside / "file").write_text("keep")
    top = base / "tree"
    top.mkdir()
    cur = os.open(top, os.O_RDONLY)
    for _ in range(3000):  # deeper than the recursion limit (and PATH_MAX)
        os.mkdir("d", dir_fd=cur)
        nxt = os.open("d", os.O_RDONLY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    os.symlink(outside, "link", dir_fd=cur)
    os.fchmod(cur, 0)
    os.close(cur)
    (top / "link_file").symlink_to(outside / "file")
    assert _cleanup.remove_tree(str(top), budget_s=30)
    assert not top.exists() and (outside / "file").read_text() == "keep"
    assert _cleanup.remove_tree(str(top))  # already gone: fine
    (top).mkdir()
    for i in range(20000):
        (top / str(i)).touch()
    t0 = time.monotonic()
    done = _cleanup.remove_tree(str(top), budget_s=0.02)
    assert time.monotonic() - t0 < 1.5  # budget 0.02 s; generous for a loaded machine
    assert done or str(top) in _cleanup.pending_removals() or not top.exists()
    assert _cleanup.finish_pending(30) == [] and not top.exists()
    base.rmdir()


def test_a_raising_reward_function_scores_zero_and_is_logged(caplog):
    import asyncio

    from masrl.workflows.base import Team, WorkflowSpec

    async def wf(task, team):
        return team.finish("answer")

    def bad_score(task, answer):
        def deep(n):
            return deep(n + 1)
        return deep(0)  # RecursionError, as the sandbox cleanup used to raise

    task = Task("t/1", "q", {"kind": "mbpp"})
    team = Team(task, WorkflowSpec("w", wf, ("Solver",), {}), call=None, score=bad_score)
    with caplog.at_level(logging.WARNING, logger="masrl.workflows.base"):
        episode = asyncio.run(wf(task, team))
    assert episode.reward == 0.0
    assert episode.info["reason"] == "score_error" and "RecursionError" in episode.info["detail"]
    assert any("reward function failed" in r.getMessage() and "t/1" in r.getMessage() for r in caplog.records)
    assert team.score("x")["reward"] == 0.0
    team_ok = Team(task, WorkflowSpec("w", wf, ("Solver",), {}), call=None,
                   score=lambda t, a: {"reward": 1, "correct": True})
    assert asyncio.run(wf(task, team_ok)).reward == 1.0


# ----------------------------------------------------------------------------------------
# 2. HumanEval: an assert inside a loop passes only when the loop finished
# ----------------------------------------------------------------------------------------
LOOP_TASK = Task("t/loop", "", {
    "kind": "humaneval", "entry_point": "inc",
    "prompt": "def inc(x):\n    \"\"\"x + 1\"\"\"\n",
    "test": ("def check(candidate):\n"
             "    for x in range(20):\n"
             "        y = candidate(x)\n"
             "        assert y == x + 1\n"
             "    assert candidate(-1) == 0\n")})
FIRST_ONLY = ("_n = [0]\ndef inc(x):\n    _n[0] += 1\n    if _n[0] > 1:\n        raise RuntimeError('gave up')\n"
              "    return x + 1\n")


@pytest.mark.parametrize("mode", ["fraction", "all"])
def test_loop_assert_fails_when_the_loop_did_not_finish(mode):
    sb = _sandbox("namespaces") if os.geteuid() == 0 else _sandbox("basic")
    r = score_code(LOOP_TASK, FIRST_ONLY, mode=mode, sandbox=sb, extract=False)
    assert r["reward"] == 0.0 and not r["correct"], r
    good = score_code(LOOP_TASK, "def inc(x):\n    return x + 1\n", mode=mode, sandbox=sb, extract=False)
    assert good["reward"] == 1.0 and good["correct"]
    # the loop assert fails in one iteration, the rest is right: fraction gives 1 of 2
    half = score_code(LOOP_TASK, "def inc(x):\n    return x + 1 if x != 3 else 0\n", mode="fraction",
                      sandbox=sb, extract=False)
    assert half["reward"] == 0.5 and [t["passed"] for t in half["tests"]] == [False, True]


def test_humaneval_32_first_polynomial_only_scores_zero():
    from masrl.paths import data_dir
    from masrl.tasks.code.data import load_humaneval

    if not (data_dir() / "code").is_dir():
        pytest.skip("HumanEval data not available")
    task = next(t for t in load_humaneval() if t.id == "HumanEval/32")
    partial = textwrap.dedent("""
        _calls = [0]
        def find_zero(xs):
            _calls[0] += 1
            if _calls[0] > 1:
                raise RuntimeError("only the first polynomial")
            lo, hi = -1000.0, 1000.0
            for _ in range(200):
                mid = (lo + hi) / 2
                if poly(xs, lo) * poly(xs, mid) <= 0:
                    hi = mid
                else:
                    lo = mid
            return lo
    """)
    sb = _sandbox("namespaces") if os.geteuid() == 0 else _sandbox("basic")
    for mode in ("fraction", "all"):
        r = score_code(task, partial, mode=mode, sandbox=sb, extract=False)
        assert r["reward"] == 0.0 and r["reason"] == "not_reached", r
    assert score_code(task, task.meta["reference_solution"], mode="all", sandbox=sb, extract=False)["correct"]


# ----------------------------------------------------------------------------------------
# 3. a fresh anonymous session keyring
# ----------------------------------------------------------------------------------------
KEY_PROBE = textwrap.dedent("""
    import ctypes, os
    nr = {"x86_64": 250, "aarch64": 219}[os.uname().machine]
    libc = ctypes.CDLL(None, use_errno=True)
    ring = libc.syscall(nr, 0, -3, 0)  # KEYCTL_GET_KEYRING_ID(@s)
    if ring < 0:
        print("keyctl-error", ctypes.get_errno())
    else:
        buf = ctypes.create_string_buffer(256)
        libc.syscall(nr, 6, ring, buf, 256)  # KEYCTL_DESCRIBE
        print("session", buf.value.decode().split(";")[-1])
        found = libc.syscall(nr, 10, ring, b"user", b"masrl-canary", 0)  # KEYCTL_SEARCH
        print("canary", "found" if found >= 0 else "absent")
""")
KEY_HARNESS = textwrap.dedent("""
    import ctypes, json, os, sys
    from masrl.sandbox import Sandbox, SandboxError, run_python
    nr = {"x86_64": (250, 248), "aarch64": (219, 217)}[os.uname().machine]
    libc = ctypes.CDLL(None, use_errno=True)
    name = sys.argv[1].encode()
    if libc.syscall(nr[0], 1, name) < 0 or libc.syscall(nr[1], b"user", b"masrl-canary", b"TOPSECRET", 9, -3) < 0:
        print(json.dumps({"skip": os.strerror(ctypes.get_errno())})); sys.exit(0)
    out = {}
    for mode in ("namespaces", "userns"):
        for seccomp in (False, True):
            try:
                sb = Sandbox(isolation=mode)
                sb.resolve()
            except SandboxError:
                continue
            sb.seccomp = seccomp and sb.seccomp
            out[f"{mode}-{seccomp}"] = run_python(sys.argv[2], sandbox=sb).stdout.split()
    print(json.dumps(out))
""")


def test_candidate_gets_a_fresh_session_keyring():
    name = f"masrl-test-{uuid.uuid4().hex[:8]}"
    proc = subprocess.run([sys.executable, "-c", KEY_HARNESS, name, KEY_PROBE], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out or not out:
        pytest.skip(f"keyrings not usable here: {out}")
    for key, words in out.items():
        if key.endswith("-True"):  # seccomp refuses keyctl altogether
            assert words[0] == "keyctl-error", (key, words)
        else:  # an anonymous session keyring of its own, without the harness's key
            assert words[:2] == ["session", "_ses"] and words[2:] == ["canary", "absent"], (key, words)


# ----------------------------------------------------------------------------------------
# 4. memory the kernel holds outside RLIMIT_AS
# ----------------------------------------------------------------------------------------
MEMFD_HOG = textwrap.dedent("""
    import os
    held, fds = 0, []
    for i in range(24):  # 16 MiB per file at most (RLIMIT_FSIZE): spread over many files
        try:
            fd = os.memfd_create(f"m{i}")
        except OSError as e:
            print("stopped", type(e).__name__)
            break
        fds.append(fd)
        try:
            for _ in range(16):
                os.write(fd, b"x" * (1 << 20))
                held += 1
        except OSError:
            pass
    print("held", held)
""")
SHM_HOG = textwrap.dedent("""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    held = 0
    for i in range(12):
        sid = libc.shmget(0, 32 << 20, 0o1600)  # IPC_PRIVATE | IPC_CREAT | 0600
        if sid < 0:
            print("shmget-error", ctypes.get_errno()); break
        addr = libc.shmat(sid, None, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            print("shmat-error", ctypes.get_errno()); break
        ctypes.memset(addr, 1, 32 << 20)
        libc.shmdt(ctypes.c_void_p(addr))  # detached: no longer in the address space
        held += 32
    print("held", held)
""")


def _held_mib(res) -> int:
    words = res.stdout.split()
    return int(words[words.index("held") + 1]) if "held" in words else 0


def test_memfd_cannot_exceed_the_memory_limit(sb):
    res = run_python(MEMFD_HOG, memory_mb=128, timeout_s=20, sandbox=sb)
    assert res.status in ("ok", "memory"), (res.status, res.stderr[-500:])
    assert _held_mib(res) < 128, res.stdout  # 384 MiB before


@pytest.mark.parametrize("mode", ["namespaces", "userns"])
def test_sysv_shm_cannot_exceed_the_memory_limit(mode):
    res = run_python(SHM_HOG, memory_mb=128, timeout_s=20, sandbox=_sandbox(mode))
    assert res.status in ("ok", "memory"), (res.status, res.stderr[-500:])
    assert _held_mib(res) < 128, res.stdout


@pytest.mark.parametrize("hog", ["memfd", "shm"])
def test_without_seccomp_the_cgroup_and_ipc_limits_hold(hog):
    """Each layer on its own: with the seccomp filter off, the per-execution cgroup (memfd) and
    the IPC namespace's shmmax/shmall (SysV shm) still bound the program."""
    sb = _sandbox("namespaces", cgroups=None)
    if hog == "memfd" and not sb.cgroups:
        pytest.skip("no writable memory cgroup here")
    saved, sb.seccomp = sb.seccomp, False
    try:
        res = run_python(MEMFD_HOG if hog == "memfd" else SHM_HOG, memory_mb=128, timeout_s=20, sandbox=sb)
    finally:
        sb.seccomp = saved
    if hog == "memfd":
        assert res.status == "memory" and "cgroup" in res.detail, (res.status, res.stdout, res.stderr[-300:])
    else:
        assert res.status == "ok" and _held_mib(res) <= 16, res.stdout


def test_cgroups_are_removed_after_each_execution(monkeypatch):
    sb = _sandbox("namespaces")
    if not sb.cgroups:
        pytest.skip("no writable memory cgroup here")
    from masrl.sandbox import _cgroup

    made: list[str] = []  # this execution's cgroups (other processes on the machine may be making their own)
    real_init = _cgroup.ExecCgroup.__init__

    def recording(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.extend(self.dirs)

    monkeypatch.setattr(_cgroup.ExecCgroup, "__init__", recording)
    res = run_python("import os\nif os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(60)\n", sandbox=sb)
    assert res.status == "ok"
    assert made and all(Path(d).name.startswith("masrl-sbx-") for d in made)
    assert not any(os.path.isdir(d) for d in made), made
    monkeypatch.undo()
    # a harness killed with SIGKILL leaves empty cgroups: the next harness sweeps them
    stale = _cgroup.ExecCgroup(64 << 20, 16)
    assert all(os.path.isdir(d) for d in stale.dirs)
    assert _cgroup.sweep_stale(min_age_s=0) >= 1
    assert not any(os.path.isdir(d) for d in stale.dirs)


# ----------------------------------------------------------------------------------------
# 5. forged oversized replies, host ptys, lone surrogates
# ----------------------------------------------------------------------------------------
FORGE = Task("t/forge", "Write f().", {
    "kind": "mbpp", "entry_point": "f", "remote_names": ["f"], "setup": "",
    "tests": ["assert f() == 1"]})
FORGER = textwrap.dedent("""
    import os, stat
    def f():
        body = b'{"seq": 1, "value": [' + b'{},' * (5 << 20) + b'{}]}'
        frame = len(body).to_bytes(4, "big") + body
        for fd in range(3, 1024):  # the reply pipe keeps its number from the host, which may have many files open
            try:
                if stat.S_ISFIFO(os.fstat(fd).st_mode):
                    os.write(fd, frame)
            except OSError:
                pass
        return 1
""")


def test_forged_huge_reply_is_refused_before_decoding(sb):
    tracemalloc.start()
    try:
        r = score_code(FORGE, FORGER, sandbox=sb, extract=False, timeout_s=10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r["reward"] == 0.0 and "protocol_error" in r["detail"], r
    assert peak < 100 << 20, peak / 2 ** 20  # 320-416 MiB when json.loads built it all


def test_reply_item_count_is_linear_and_right():
    """The pre-decoding count is C-speed on any bytes (no regex retried from every quote) and
    does not take text inside strings for structure."""
    import json

    from masrl.sandbox.pipes import json_items as _json_items

    budget = 1 << 18
    hostile = {
        "escaped quotes": b'"' + b'\\"' * (8 << 20),
        "empty strings": b'[' + b'"",' * (5 << 20) + b'""]',
        "dicts": b'[' + b'{},' * (5 << 20) + b'{}]',
        "escapes then commas": b'["' + b'\\"' * (4 << 20) + b',' * (1 << 20) + b'"]',
    }
    t0 = time.monotonic()
    verdicts = {k: _json_items(v, budget) > budget for k, v in hostile.items()}
    assert time.monotonic() - t0 < 3.0
    assert verdicts == {"escaped quotes": False, "empty strings": True, "dicts": True, "escapes then commas": False}
    legit = json.dumps({"seq": 1, "value": ["L"] + ["a,b:[{"] * 1000 + list(range(1000))}).encode()
    assert _json_items(legit, 1000) > 1000 and _json_items(legit, budget) <= budget  # 2,003 values


def test_no_host_pseudo_terminals(sb):
    res = run_python(textwrap.dedent("""
        import os
        got = 0
        for _ in range(8):
            try:
                m, s = os.openpty()
                os.ttyname(s)
                got += 1
            except Exception:
                pass
            for path in ("/dev/ptmx", "/dev/pts/ptmx"):
                try:
                    fd = os.open(path, os.O_RDWR | os.O_NOCTTY)
                except OSError:
                    continue
                try:
                    import fcntl, struct
                    fcntl.ioctl(fd, 0x80045430, struct.pack("I", 0))  # TIOCGPTN: a real pty master?
                    got += 1
                except OSError:
                    pass
        print("ptys", got)
    """), sandbox=sb)
    assert res.status == "ok" and res.stdout.split() == ["ptys", "0"], (res.stdout, res.stderr[-500:])


def test_lone_surrogates_never_raise(sb):
    res = run_python("x = '\ud800'\nprint(1)\n", sandbox=sb)  # UnicodeEncodeError in the harness before
    assert res.status == "error"
    res = run_python("import sys\nprint(len(sys.stdin.buffer.read()))", stdin="a\udc80\ud800", sandbox=sb)
    assert res.status == "ok" and res.stdout.strip() == "7"
    r = score_code(FORGE, "def f():\n    return '\ud800'\n", sandbox=sb, extract=False)
    assert r["reward"] == 0.0


def test_sandbox_and_scoring_do_not_import_each_other():
    """The sandbox is a service: none of its modules imports a task; the code scorer imports it."""
    import masrl.sandbox as sandbox_mod
    import masrl.codecheck.scoring as scoring_mod

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        return ({n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} |
                {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names})

    files = sorted(Path(sandbox_mod.__file__).parent.glob("*.py"))
    assert len(files) >= 8
    for f in files:
        assert not any(m.startswith("masrl.tasks") for m in imports(f)), f
    assert "masrl.sandbox" in imports(Path(scoring_mod.__file__))


def test_cgroup_v2_layout_and_limits(tmp_path, monkeypatch):
    """The cgroup v2 path (this machine has the memory controller on v1): a delegated parent
    whose children may use the memory controller gets one child per execution with
    memory.max = memory_mb, no swap, group OOM kill and pids.max; the OOM count is read back."""
    from masrl.sandbox import _cgroup

    (tmp_path / "svc" / "leaf").mkdir(parents=True)
    (tmp_path / "svc" / "cgroup.subtree_control").write_text("cpu memory pids\n")
    (tmp_path / "svc" / "leaf" / "cgroup.subtree_control").write_text("\n")  # ours: holds processes
    monkeypatch.setattr(_cgroup, "_mounts", lambda: {"": str(tmp_path)})
    monkeypatch.setattr(_cgroup, "_own_paths", lambda: {"": "/svc/leaf"})
    _cgroup.layout.cache_clear()
    try:
        assert _cgroup.layout() == ("v2", {"": str(tmp_path / "svc")})
        cg = _cgroup.ExecCgroup(128 << 20, 40)
        d = Path(cg.dirs[0])
        assert d.parent == tmp_path / "svc" and d.name.startswith("masrl-sbx-")
        assert (d / "memory.max").read_text() == str(128 << 20) and (d / "memory.swap.max").read_text() == "0"
        assert (d / "memory.oom.group").read_text() == "1" and (d / "pids.max").read_text() == "40"
        assert cg.procs_files == [str(d / "cgroup.procs")] and not cg.oom_killed()
        (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
        assert cg.oom_killed()
        (tmp_path / "svc" / "cgroup.subtree_control").write_text("cpu\n")
        _cgroup.layout.cache_clear()
        assert _cgroup.layout() is None or _cgroup.layout()[0] == "v1"
    finally:
        _cgroup.layout.cache_clear()


def test_code_extraction_is_linear_on_a_long_fence_line():
    """A reply line of a fence, 200k letters and a backtick backtracked quadratically in the
    fence pattern (minutes in the reward function); the extraction result is unchanged."""
    from masrl.codecheck.extract import extract_code

    t0 = time.monotonic()
    assert extract_code("```" + "a" * 200_000 + "`") == "```" + "a" * 200_000 + "`"
    assert time.monotonic() - t0 < 1.0
    assert extract_code("``` python extra words\nprint(1)\n```\n") == "print(1)"
    # the same openers as the single pattern it replaces
    import itertools
    import re

    from masrl.codecheck import extract

    old = re.compile(r"^[ \t]{0,3}(`{3,}|~{3,})[ \t]*([^\s`]*)[^\n`]*$")
    for parts in itertools.product(["", " ", "    ", "\t"], ["```", "````", "~~~", "``"], ["", " ", "\t"],
                                   ["", "py", "Python3", "{.python}", "a`b"], ["", " x y", " `", "\x0c", "~"]):
        line = "".join(parts)
        m = old.match(line)
        new = extract._FENCE.match(line)
        new_ok = bool(new) and "`" not in line[new.end():]
        assert bool(m) == new_ok, repr(line)
        if m:
            assert m.group(1) == new.group(1) and m.group(2) == extract._LANG.match(line, new.end()).group(1)
