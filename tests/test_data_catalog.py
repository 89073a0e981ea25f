"""`masrl data`: the catalogue, where masrl looks for data, verification and `get` from a file or a Hub
conversion (offline: the Hub's rows come from a stand-in for `datasets.load_dataset` built from the
reference copies, so the conversion code itself is what is tested)."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from masrl import catalog
from masrl.catalog import CATALOG, DataError, DataNotFoundError
from masrl.cli import main
from masrl.paths import data_roots

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not (SHARED / "math" / "gsm8k_test.jsonl").is_file(), reason="no shared data")


@pytest.fixture
def empty_data(tmp_path, monkeypatch):
    root = tmp_path / "data"
    monkeypatch.setenv("MASRL_DATA_DIR", str(root))
    return root


def _rows(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _fake_hub(rows_by_split: dict[str, list[dict]]):
    calls = []

    def load_dataset(repo, config=None, split=None):
        calls.append((repo, config, split))
        return list(rows_by_split[split])
    return load_dataset, calls


def test_catalogue_names_every_file_the_loaders_read():
    from masrl.tasks.math_data import BENCHMARKS
    from masrl.tasks.qa import QA_DATASETS

    files = {f.rel for e in CATALOG.values() for f in e.files}
    assert {rel for rel, _ in BENCHMARKS.values()} <= files
    assert set(QA_DATASETS.values()) <= files
    assert {"code/mbpp.jsonl", "code/HumanEval.jsonl.gz"} <= files


@needs_data
def test_reference_copies_verify(monkeypatch):
    monkeypatch.setenv("MASRL_DATA_DIR", str(SHARED))
    rows = catalog.verify()
    assert rows and all(status == "verified" for _, _, status, _ in rows), [r for r in rows if r[2] != "verified"]


def test_env_var_is_the_only_root(empty_data):
    assert data_roots() == [empty_data]


def test_checkout_looks_in_shared_then_user_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("MASRL_DATA_DIR", raising=False)
    monkeypatch.setattr("platformdirs.user_data_dir", lambda *a, **k: str(tmp_path / "user"))
    roots = data_roots()
    assert roots[0].parts[-2:] == ("shared", "data") and roots[-1] == tmp_path / "user" / "data"


def test_wheel_install_uses_the_user_folder_only(monkeypatch, tmp_path):
    monkeypatch.delenv("MASRL_DATA_DIR", raising=False)
    monkeypatch.setattr("masrl.paths.REPO_ROOT", tmp_path / "venv" / "lib")  # what a wheel install resolves to
    monkeypatch.setattr("platformdirs.user_data_dir", lambda *a, **k: str(tmp_path / "user"))
    assert data_roots() == [tmp_path / "user" / "data"]


def test_missing_benchmark_names_the_get_command(empty_data):
    from masrl.tasks.math_data import load_benchmark

    with pytest.raises(DataNotFoundError, match=r"masrl data get gsm8k"):
        load_benchmark("gsm8k")
    with pytest.raises(FileNotFoundError, match=r"masrl data get mbpp"):  # still a FileNotFoundError
        from masrl.tasks.code.data import load_mbpp
        load_mbpp()


@needs_data
def test_get_from_a_local_file_verifies_and_installs(empty_data, capsys):
    assert main(["data", "get", "gsm8k", "--from", str(SHARED / "math" / "gsm8k_test.jsonl")]) == 0
    dest = empty_data / "math" / "gsm8k_test.jsonl"
    assert dest.read_bytes() == (SHARED / "math" / "gsm8k_test.jsonl").read_bytes()
    assert "verified" in capsys.readouterr().out
    from masrl.tasks.math_data import load_benchmark
    assert len(load_benchmark("gsm8k")) == 1319
    assert main(["data", "get", "gsm8k", "--from", str(SHARED / "math" / "gsm8k_test.jsonl")]) == 0
    assert "already there" in capsys.readouterr().out


@needs_data
def test_get_refuses_the_wrong_file_and_keeps_nothing(empty_data, capsys):
    assert main(["data", "get", "gsm8k", "--from", str(SHARED / "math" / "math500_test.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "not the expected file" in err and "nothing was installed" in err and "Traceback" not in err
    assert [p for p in empty_data.rglob("*") if p.is_file()] == []  # neither the file nor a partial one


@needs_data
def test_get_a_multi_file_entry_from_a_folder(empty_data):
    done = catalog.get("rlfocal_bbh", str(SHARED))
    assert [s for _, s, _ in done] == ["verified"] * 3


@needs_data
def test_corpus_by_name(empty_data):
    from masrl.retrieval.corpus import CorpusError, load_corpus

    with pytest.raises(CorpusError, match="masrl data get searchr1_example_corpus --from"):
        load_corpus("searchr1_example_corpus")
    catalog.get("searchr1_example_corpus", str(SHARED / "corpus" / "searchr1_example_corpus.jsonl"))
    assert len(load_corpus("searchr1_example_corpus")) == 10
    assert len(load_corpus("corpus/searchr1_example_corpus.jsonl")) == 10


@needs_data
def test_hub_conversion_of_gsm8k_is_byte_identical(empty_data):
    rows = [{**r, "extra": 1} for r in _rows(SHARED / "math" / "gsm8k_test.jsonl")]  # extra columns are dropped
    load, calls = _fake_hub({"test": rows})
    (path, status, _), = catalog.get("gsm8k", load_dataset=load)
    assert calls == [("openai/gsm8k", "main", "test")]
    assert status == "verified" and path.read_bytes() == (SHARED / "math" / "gsm8k_test.jsonl").read_bytes()


@needs_data
def test_hub_conversion_of_mbpp_joins_and_sorts_the_splits(empty_data):
    ref = _rows(SHARED / "code" / "mbpp.jsonl")
    splits = {"prompt": ref[:10], "test": ref[10:510], "validation": ref[510:600], "train": ref[600:]}
    load, calls = _fake_hub({k: list(reversed(v)) for k, v in splits.items()})  # order restored by task_id
    (path, status, detail), = catalog.get("mbpp", load_dataset=load)
    assert [c[2] for c in calls] == ["train", "test", "validation", "prompt"]
    assert status in ("verified", "converted"), detail
    assert _rows(path) == ref


@needs_data
def test_hub_conversion_writes_gzip_for_humaneval(empty_data):
    ref = _rows(SHARED / "code" / "HumanEval.jsonl.gz")
    load, _ = _fake_hub({"test": ref})
    (path, status, detail), = catalog.get("humaneval", load_dataset=load)
    assert status in ("verified", "converted"), detail
    assert _rows(path) == ref


def test_hub_rows_with_the_wrong_count_are_refused(empty_data):
    load, _ = _fake_hub({"test": [{"question": "q", "answer": "#### 1"}] * 3})
    with pytest.raises(DataError, match=r"3 rows, expected 1,319"):
        catalog.get("gsm8k", load_dataset=load)
    assert not (empty_data / "math" / "gsm8k_test.jsonl").exists()


def test_hub_failure_is_one_line(empty_data):
    def offline(*a, **k):
        raise ConnectionError("offline")
    with pytest.raises(DataError, match=r"cannot fetch openai/gsm8k .*--from"):
        catalog.get("gsm8k", load_dataset=offline)


def test_no_hub_source_says_to_give_a_file(empty_data, capsys):
    assert main(["data", "get", "aime24"]) == 2
    assert "--from FILE_OR_URL" in capsys.readouterr().err


def test_unknown_name_lists_the_known(capsys):
    assert main(["data", "path", "gsm9k"]) == 2
    assert "known:" in capsys.readouterr().err


@needs_data
def test_verify_flags_a_damaged_file(empty_data, capsys):
    dest = empty_data / "math" / "amc23_test.jsonl"
    dest.parent.mkdir(parents=True)
    shutil.copyfile(SHARED / "math" / "amc23_test.jsonl", dest)
    assert main(["data", "verify", "amc23"]) == 0
    dest.write_bytes(dest.read_bytes()[:-10])
    assert main(["data", "verify", "amc23"]) == 1
    assert "bad" in capsys.readouterr().out


def test_list_and_path_report_absence(empty_data, capsys):
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "gsm8k" in out and "missing" in out and str(empty_data) in out
    assert main(["data", "path", "gsm8k"]) == 1
    assert "masrl data get gsm8k" in capsys.readouterr().out


@needs_data
def test_get_from_a_url(empty_data):
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(SHARED))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/math/amc23_test.jsonl"
        (path, status, _), = catalog.get("amc23", url)
        assert status == "verified" and path == empty_data / "math" / "amc23_test.jsonl"
        with pytest.raises(DataError, match="not the expected file"):  # a URL serving another file
            catalog.get("aime25", url)
    finally:
        server.shutdown()
        server.server_close()


def test_every_sourced_entry_names_a_url_a_user_can_open():
    """A catalogue source is an https URL (the ensemble tables, described in their data folder's README, apart)."""
    import urllib.parse

    for e in CATALOG.values():
        if e.kind == "ensembles":
            continue
        url = urllib.parse.urlparse(e.source)
        assert url.scheme == "https" and url.netloc and " " not in e.source, (e.name, e.source)


def test_an_unreachable_hub_is_one_line_at_once(empty_data, monkeypatch, capsys):
    """No retries: one request that fails (a closed local port here) ends the fetch, nothing is written."""
    import time

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(catalog, "_default_load_dataset", lambda: lambda *a, **k: pytest.fail("the Hub was not probed"))
    t0 = time.perf_counter()
    assert main(["data", "get", "gsm8k"]) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - t0 < 10
    assert len(err.strip().splitlines()) == 1 and "cannot be reached" in err and "--from FILE_OR_URL" in err
    assert not empty_data.exists()


def test_read_only_data_commands_create_no_folder(tmp_path, monkeypatch, capsys):
    """`masrl data list`, `path` and `verify` read; a fresh home stays empty (outside a checkout, where the
    user data folder is the only root)."""
    import masrl.paths

    monkeypatch.delenv("MASRL_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(masrl.paths, "in_checkout", lambda: False)
    for argv in (["data", "list"], ["data", "path", "gsm8k"], ["data", "verify"]):
        main(argv)
    capsys.readouterr()
    assert list(tmp_path.iterdir()) == []


def test_a_hub_fetch_without_datasets_names_the_extra_before_the_network(empty_data, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert main(["data", "get", "gsm8k"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'masrl[hf]'" in err and "cannot be reached" not in err
