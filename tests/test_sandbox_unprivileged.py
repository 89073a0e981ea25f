"""The sandbox used by an unprivileged harness (the common case outside containers).

Runs a small harness as uid 65534 ('nobody') through ``setpriv`` with the system Python, and
checks the ``userns`` level (unprivileged user namespaces) and the ``basic`` fallback. Needs
root (to switch user), ``setpriv`` and a system Python >= 3.10 that 'nobody' can run; skips
otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import masrl

SRC = str(Path(masrl.__file__).resolve().parents[1])
SYSTEM_PYTHON = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), None)

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a harness as another user"),
    pytest.mark.skipif(shutil.which("setpriv") is None or SYSTEM_PYTHON is None, reason="needs setpriv and a system Python"),
]

HARNESS = textwrap.dedent(r"""
    import json, os, sys
    try:
        from masrl.sandbox import Limits, Sandbox, SandboxError
    except Exception as e:
        print(json.dumps({"import_error": repr(e)})); sys.exit(0)
    secret, port, victim = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    out = {}
    for mode in ("auto", "basic"):
        try:
            sb = Sandbox(isolation=mode, limits=Limits(timeout_s=10, nproc=10, memory_mb=512))
            r = {"isolation": sb.describe()["isolation"]}
        except SandboxError as e:
            out[mode] = {"error": str(e)}
            continue
        r["loop"] = sb.run("while True: pass", timeout_s=1).status
        r["fork"] = sb.run(
            "import os, time\npids, err = [], None\nfor i in range(50):\n"
            "    try:\n        pid = os.fork()\n    except Exception as e:\n        err = type(e).__name__; break\n"
            "    if pid == 0:\n        time.sleep(20); os._exit(0)\n    pids.append(pid)\nprint(len(pids), err)\n").stdout.split()
        r["read_secret"] = sb.run(f"print(open({secret!r}).read())").stdout
        r["delete"] = sb.run(f"import os\nos.remove({victim!r})").status
        r["kill_harness"] = sb.run(f"import os\ntry:\n    os.kill({os.getpid()}, 0)\n    print('reachable')\n"
                                   f"except Exception as e:\n    print(type(e).__name__)").stdout.strip()
        r["connect"] = sb.run(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                              f"    print('CONNECTED')\nexcept Exception as e:\n    print(type(e).__name__)").stdout.strip()
        r["write_tmp"] = sb.run(f"open('/tmp/masrl_pwned_{os.getpid()}_{mode}', 'w').write('x')").status
        r["memory"] = sb.run("x = bytearray(4 << 30)", memory_mb=256).status
        r["memfd"] = sb.run("import os\ntry:\n    os.memfd_create('m')\n    print('MEMFD')\n"
                            "except OSError as e:\n    print(type(e).__name__)").stdout.strip()
        r["pty"] = sb.run("import os\ntry:\n    m, s = os.openpty()\n    print(os.ttyname(s))\n"
                          "except Exception as e:\n    print(type(e).__name__)").stdout.strip()
        r["deep"] = sb.run("import os\nfor i in range(1100):\n    os.mkdir('d')\n    os.chdir('d')\n").status
        out[mode] = r
    print(json.dumps(out))
""")


def test_unprivileged_harness(tmp_path):
    os.chmod(tmp_path, 0o777)
    secret_dir = tmp_path / "nobody_home"
    secret_dir.mkdir()
    secret = secret_dir / "secret.txt"
    secret.write_text("TOPSECRET")
    victim = secret_dir / "victim.txt"
    victim.write_text("keep")
    for p in (secret_dir, secret, victim):
        os.chown(p, 65534, 65534)
    os.chmod(secret_dir, 0o700)
    os.chmod(secret, 0o600)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    srv.settimeout(0.1)
    port = srv.getsockname()[1]
    tag = uuid.uuid4().hex[:6]
    try:
        proc = subprocess.run(
            ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "env", "-i", "PATH=/usr/bin:/bin",
             f"PYTHONPATH={SRC}", f"TMPDIR={tmp_path}", f"MASRL_DATA_DIR=/nonexistent-{tag}",
             SYSTEM_PYTHON, "-c", HARNESS, str(secret), str(port), str(victim)],
            capture_output=True, text=True, timeout=120, cwd=tmp_path)
        try:
            conn, _ = srv.accept()
            conn.close()
            accepted = True
        except OSError:
            accepted = False
    finally:
        srv.close()
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.skip(f"cannot run the harness as nobody: {proc.stderr[-500:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "import_error" in out:
        pytest.skip(f"masrl does not import under the system Python: {out['import_error']}")
    assert not accepted
    assert victim.read_text() == "keep"
    assert not list(Path("/tmp").glob("masrl_pwned_*"))
    for mode, r in out.items():
        assert "error" not in r, (mode, r)
        assert r["loop"] == "timeout", (mode, r)
        forked, err = r["fork"]
        assert int(forked) < 10 and err != "None", (mode, r)
        assert "TOPSECRET" not in r["read_secret"], (mode, r)
        assert r["kill_harness"] != "reachable", (mode, r)
        assert "CONNECTED" not in r["connect"], (mode, r)
        assert r["write_tmp"] != "ok" or r["isolation"] != "basic", (mode, r)
        assert r["memory"] == "memory", (mode, r)
        assert r["memfd"] != "MEMFD" and not r["pty"].startswith("/dev/"), (mode, r)
        assert r["deep"] == "ok", (mode, r)
    assert out["basic"]["isolation"] == "basic"
