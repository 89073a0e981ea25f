import importlib.util
import os
import socket
import struct
import sys
from pathlib import Path

import pytest
import torch

# Tests run on 2 shared cores: one intra-op thread avoids OpenMP oversubscription.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(relpath: str, name: str | None = None):
    """A script under ``benchmarks/`` imported as a module (it is not a package); ``benchmarks/`` goes on
    ``sys.path`` for the scripts' own ``_benchutil`` imports."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    path = BENCHMARKS / relpath
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_config_dict(tmp_path, **over):
    """A minimal two-agent config: tiny model, few tokens, 2 RL steps."""
    cfg = {
        "name": "test", "seed": 0, "output_dir": str(tmp_path / "run"),
        "task": {"name": "arithmetic", "params": {"train_size": 64, "test_size": 8, "max_operand": 9}},
        "workflow": {"name": "math_solver_verifier", "params": {"max_loops": 2},
                     "prompts": {"Solver": "Q {question}\n{context}S ", "Verifier": "Q {question}\n{context}V ",
                                 "context": "{text}\n"}},
        "agents": {"Solver": {"policy": "shared", "max_new_tokens": 8},
                   "Verifier": {"policy": "shared", "max_new_tokens": 4}},
        "policies": {"shared": {"model": "tiny", "optim": {"lr": 1e-3},
                                "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                         "num_key_value_heads": 2, "intermediate_size": 64,
                                         "max_position_embeddings": 128}}},
        "sft": {"steps": 40, "batch_size": 16, "lr": 1e-2, "teacher": {"error_rate": 0.3}},
        "trainer": {"total_steps": 2, "batch_size": 3, "group_size": 4},
        "eval": {"n": 2, "k": [1, 2], "limit": 3},
        "logging": {"progress": False, "tensorboard": True, "plots": True},
    }
    for key, value in over.items():
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return cfg


# A 2-layer tiny Llama for engine tests (max 256 positions)
SMALL_TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
              "intermediate_size": 64, "max_position_embeddings": 256}


@pytest.fixture()
def tiny():
    """``(model, tokenizer)``: a fresh :data:`SMALL_TINY` model in eval mode (seed 0) and the char tokenizer."""
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    return build_tiny_model(tok, SMALL_TINY, seed=0).eval(), tok


@pytest.fixture
def tiny_cfg(tmp_path):
    return lambda **over: tiny_config_dict(tmp_path, **over)


# ----------------------------------------------------------------------------- sandboxes shared by the sandbox tests
# "basic-setuid": the no-namespace fallback with a Python that an unprivileged uid can run (the system one),
# so that as root it still drops to a fresh uid
SANDBOX_MODES = ["namespaces", "userns", "basic", "basic-setuid"]
SYSTEM_PYTHON = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), None)
# a tmpfs for work directories where there is one: removing thousands of entries on a busy disk takes
# seconds that have nothing to do with what is tested
FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
_SANDBOXES: dict = {}


def cached_sandbox(mode: str, *, max_workers: int = 2, own_tmp: bool = False, **kwargs):
    """One resolved ``Sandbox`` per ``(mode, settings)`` for the whole test run, with the tests' limits
    (10 s, 512 MB, 16 processes); the test is skipped where that isolation does not work here.

    ``own_tmp``: work directories in a fresh folder (on :data:`FAST_TMP`), removed at exit, so a test can
    count what is left in it; ``kwargs`` go to ``Sandbox``.
    """
    import atexit
    import tempfile

    from masrl.sandbox import Limits, Sandbox, SandboxError, _cleanup

    key = (mode, max_workers, own_tmp, tuple(sorted(kwargs.items())))
    if key not in _SANDBOXES:
        if mode == "basic-setuid":
            if os.geteuid() != 0 or SYSTEM_PYTHON is None:
                pytest.skip("needs root and a system Python")
            kwargs["python"] = SYSTEM_PYTHON
        if own_tmp:
            root = tempfile.mkdtemp(prefix="masrl-test-sbx-", dir=FAST_TMP)
            os.chmod(root, 0o711)  # the execution's uid must reach its work dir
            atexit.register(_cleanup.remove_tree, root, 10.0)
            kwargs["tmp_root"] = root
        try:
            sb = Sandbox(max_workers=max_workers, isolation=mode.split("-")[0],
                         limits=Limits(timeout_s=10, memory_mb=512, nproc=16), **kwargs)
            sb.resolve()
            if mode == "basic-setuid" and not sb.isolation.setuid:
                raise SandboxError("the system Python is not reachable by other users")
        except SandboxError as e:
            sb = e
        _SANDBOXES[key] = sb
    sb = _SANDBOXES[key]
    if isinstance(sb, Exception):
        pytest.skip(f"isolation {mode!r} not available here: {str(sb)[:200]}")
    return sb


# ---- a rollout without an engine (run_episodes with a scripted team.call backend)

class GatheringScheduler:
    """The rollout scheduler's ``run`` and ``stats`` for episodes whose calls go to a scripted backend."""

    def __init__(self):
        from masrl.rollout.scheduler import RolloutStats
        self.stats = RolloutStats()

    def run(self, coroutines):
        import asyncio

        async def main():
            return await asyncio.gather(*coroutines)
        return asyncio.run(main())


# ---- raw HTTP from a test client (the gateway's and masrl serve --team's conduct)

def read_response(sock) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length from ``sock``: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def drip(sock, data: bytes, interval_s: float) -> bytes:
    """Send ``data`` one byte every ``interval_s`` until the server answers or closes: what it answered."""
    sock.settimeout(interval_s)
    reply = b""
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
            reply += sock.recv(65536)
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        if reply:
            break
    return reply


def hang_up(address, request: bytes, reset: bool) -> None:
    """Connect to ``address``, send ``request`` (maybe nothing) and go away: closed, or reset when ``reset``."""
    sock = socket.create_connection(address, timeout=5)
    if reset:  # close with a RST: the server's next read or write fails
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    if request:
        sock.sendall(request)
    sock.close()


def route_answer(address, method: str, path: str) -> tuple[int, object, bytes]:
    """``method path`` (a body ``{}`` where the method takes one): (status, the response, its body)."""
    import http.client

    conn = http.client.HTTPConnection(*address, timeout=10)
    conn.request(method, path, body=b"{}" if method in ("POST", "PUT", "PATCH") else None)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, response, body


def two_requests(address, first: bytes, second: bytes):
    """``first`` then ``second`` on one connection: (first's answer, second's, whatever else came within 0.5 s)."""
    sock = socket.create_connection(address, timeout=10)
    sock.sendall(first)
    answers = [read_response(sock)]
    sock.sendall(second)
    answers.append(read_response(sock))
    sock.settimeout(0.5)
    try:
        stray = sock.recv(65536)
    except socket.timeout:
        stray = b""
    sock.close()
    return answers[0], answers[1], stray


# ----------------------------------------------------------------------------- rollout.max_staleness in a real run
def train_with_slow_update(cfg) -> tuple[list, list[float], dict]:
    """Train ``cfg`` (``rollout.max_staleness`` k > 0) with a slow update and a fast rollout: the update of step t
    starts only once the producer has generated every batch the bound lets it generate meanwhile (t + k under
    ``stale: wait``, one more under ``drop``), so the oldest turns the bound allows do reach the trainer. Returns
    the staleness of every turn that reached the loss, each step's ``rollout/stale_dropped``, and each policy's
    engine version at the end."""
    from masrl.monitoring.logger import read_metrics
    from masrl.rollout.versioned import staleness
    from masrl.trainer import Trainer

    ages: list = []
    with Trainer(cfg, progress=False) as trainer:
        real_update = trainer.update

        def slow_update(turns, advantages):
            ahead, step = trainer.ahead, trainer.step
            lead = min(step + ahead.k + (0 if ahead.wait else 1), cfg.trainer.total_steps - 1)
            with ahead.cond:
                ahead.cond.wait_for(lambda: lead == step or lead in ahead.results)
            ages.extend(staleness(turns, {n: p.engine.version for n, p in trainer.policies.items()}))
            return real_update(turns, advantages)

        trainer.update = slow_update
        trainer.fit()
        versions = {n: p.engine.version for n, p in trainer.policies.items()}
    dropped = [r["rollout/stale_dropped"] for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    return ages, dropped, versions
