"""The data catalogue: every benchmark file and corpus masrl reads, where it looks, and how to get it.

masrl reads benchmark data from data folders (``masrl.paths.data_roots()``: ``$MASRL_DATA_DIR`` alone when it
is set; otherwise the checkout's ``../shared/data`` when masrl runs from a source checkout, then the user data
folder). Each catalogue entry names its files with their size and SHA-256 as published in the reference copy,
the source they were taken from, the licence, and, where an exact conversion exists, the Hugging Face Hub
dataset ``masrl data get NAME`` fetches it from (through the ``datasets`` library). ``masrl data get NAME
--from FILE_OR_URL`` installs a copy the user has (checked before it is kept).

A file is *verified* when its SHA-256 equals the reference copy's; a file converted from the Hub is
*converted* when it holds the expected number of rows, each a JSON object with the expected fields (its
bytes may differ from the reference copy in JSON formatting, which changes no row).
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from masrl.errors import UserInputError, missing_extra
from masrl.paths import check_output_dir, data_dir, data_roots, sha256_file, user_data_dir

MAX_DOWNLOAD_FACTOR = 4  # a download may be at most this many times the reference size (plus 1 MiB)
URL_TIMEOUT_S = 60.0


class DataError(UserInputError):
    """A data set that is unknown, damaged or cannot be fetched: one line saying what to do (exit 2)."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A data file in no data folder; the message names the ``masrl data get`` line that gets it."""


@dataclass(frozen=True)
class DataFile:
    rel: str          # path under a data folder
    bytes: int        # size of the reference copy
    sha256: str       # SHA-256 of the reference copy


@dataclass(frozen=True)
class HubSource:
    """An exact conversion from a Hub dataset: ``splits`` of ``repo`` (``config``) concatenated in order,
    sorted by ``sort_key`` when given, each row's ``fields`` written in that order as one JSON line."""

    repo: str
    splits: tuple[str, ...]
    fields: tuple[str, ...]
    config: Optional[str] = None
    sort_key: Optional[str] = None


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str         # math | qa | code | corpus | ensembles
    files: tuple[DataFile, ...]
    rows: int         # rows (or passages / questions) in the first file
    licence: str
    source: str
    hub: Optional[HubSource] = None
    notes: str = ""

    @property
    def size(self) -> int:
        return sum(f.bytes for f in self.files)


def _f(rel: str, size: int, sha: str) -> tuple[DataFile, ...]:
    return (DataFile(rel, size, sha),)


_GSM8K_FIELDS = ("question", "answer")
CATALOG: dict[str, Entry] = {e.name: e for e in [
    Entry("gsm8k", "math", _f("math/gsm8k_test.jsonl", 749738,
                              "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"),
          1319, "MIT", "https://github.com/openai/grade-school-math/blob/3101c7d5/grade_school_math/data/test.jsonl",
          HubSource("openai/gsm8k", ("test",), _GSM8K_FIELDS, config="main")),
    Entry("gsm8k_train", "math", _f("math/gsm8k_train.jsonl", 4166206,
                                    "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465"),
          7473, "MIT", "https://github.com/openai/grade-school-math/blob/3101c7d5/grade_school_math/data/train.jsonl",
          HubSource("openai/gsm8k", ("train",), _GSM8K_FIELDS, config="main")),
    Entry("math500", "math", _f("math/math500_test.jsonl", 446564,
                                "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132"),
          500, "MIT", "https://github.com/ZubinGou/math-evaluation-harness/blob/db77bc6b/data/math_oai/test.jsonl",
          HubSource("HuggingFaceH4/MATH-500", ("test",),
                    ("problem", "solution", "answer", "subject", "level", "unique_id"))),
    Entry("aime24", "math", _f("math/aime24_test.jsonl", 156944,
                               "af2b8bd2aa911b6333ad0df32f3ca05c7ae8ed10f1731f4372c8ae26990bf7ac"),
          30, "none stated (AIME 2024, MAA)",
          "https://github.com/QwenLM/Qwen2.5-Math/blob/a45202bd/evaluation/data/aime24/test.jsonl"),
    Entry("aime25", "math", _f("math/aime25_test.jsonl", 18551,
                               "3e24561227261150e56cd67f06d1c0fb5b2eeb282e72c0ec8216b3133aea6637"),
          30, "none stated (AIME 2025, MAA)",
          "https://github.com/ZhangShimin1/PassKEval/blob/4a1495c8/data/aime2025/test.jsonl"),
    Entry("amc23", "math", _f("math/amc23_test.jsonl", 27631,
                              "43707e1ca784602d8479de24ee8ce36609dbebc46dd152b0b12a46611aa898a4"),
          40, "none stated (AMC 2023, MAA)",
          "https://github.com/QwenLM/Qwen2.5-Math/blob/a45202bd/evaluation/data/amc23/test.jsonl"),
    Entry("olympiadbench", "math", _f("math/olympiadbench_test.jsonl", 1493870,
                                      "bb8c1e38a16ea9eacb77530315a674d883f267fbff79183effc53681b4fcc416"),
          675, "none stated",
          "https://github.com/QwenLM/Qwen2.5-Math/blob/a45202bd/evaluation/data/olympiadbench/test.jsonl"),
    Entry("minerva", "math", _f("math/minerva_math_test.jsonl", 247267,
                                "0e656b430d3a0a1dab6aa853f453ba3805e28e2cabe4fc72486a897cc09d8ba2"),
          272, "CC BY-NC-SA (MIT OCW)",
          "https://github.com/QwenLM/Qwen2.5-Math/blob/a45202bd/evaluation/data/minerva_math/test.jsonl"),
    Entry("humaneval", "code", _f("code/HumanEval.jsonl.gz", 44877,
                                  "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
          164, "MIT", "https://github.com/openai/human-eval/blob/6d43fb98/data/HumanEval.jsonl.gz",
          HubSource("openai/openai_humaneval", ("test",),
                    ("task_id", "prompt", "entry_point", "canonical_solution", "test"))),
    Entry("mbpp", "code", _f("code/mbpp.jsonl", 563743,
                             "ccf64ceae9c5403bf50a044cb6d505bfd2a2963ee58338ba268fd65beab92a9f"),
          974, "CC BY 4.0",
          "https://github.com/OckBench/OckBench/blob/b72752a0/data/mbpp.jsonl",
          HubSource("google-research-datasets/mbpp", ("train", "test", "validation", "prompt"),
                    ("text", "code", "task_id", "test_setup_code", "test_list", "challenge_test_list"),
                    config="full", sort_key="task_id"),
          notes="Google Research's MBPP (https://github.com/google-research/google-research/tree/master/mbpp)"),
    Entry("bamboogle", "qa", _f("qa/bamboogle_test.jsonl", 17031,
                                "c9703dae6bb1ceb9e2df77be45da28cb12aa040d2f471507890a461296968f3f"),
          125, "none stated",
          "https://github.com/GaurisankarJ/reason_over_search/blob/45495b57/data_subsample/bamboogle/test.jsonl"),
    Entry("nq", "qa", _f("qa/nq_test_sub1000.jsonl", 134245,
                         "a95e3864de49e0339b433a5235451895d98cfa38d0bc4e8013dc2b1439b569be"),
          1000, "CC BY-SA 3.0",
          "https://github.com/GaurisankarJ/reason_over_search/blob/45495b57/data_subsample/nq/test.jsonl",
          notes="a fixed random 1,000 of FlashRAG's NQ test split"),
    Entry("triviaqa", "qa", _f("qa/triviaqa_test_sub1000.jsonl", 397059,
                               "4a46971e676400b102885b4690f26014cbfed71d6d9785f134b22182170e58e3"),
          1000, "Apache-2.0",
          "https://github.com/GaurisankarJ/reason_over_search/blob/45495b57/data_subsample/triviaqa/test.jsonl"),
    Entry("popqa", "qa", _f("qa/popqa_test_sub1000.jsonl", 601807,
                            "849ee23a02b395acb68dddbb7789ab86dd9e818765ed804696eab4760f042aea"),
          1000, "MIT",
          "https://github.com/GaurisankarJ/reason_over_search/blob/45495b57/data_subsample/popqa/test.jsonl"),
    Entry("nq_full", "qa", _f("qa/nq_test_full_qa.json", 394926,
                              "72ef06d7750154e7a70b328f6bcdc40b6abcec32d3ff34836805f108214f1889"),
          3610, "CC BY-SA 3.0",
          "https://github.com/chenyiqun/Agentic-RAG/blob/a6694e2e/data/nq/nq_test_questions_and_answers.json"),
    Entry("hotpotqa", "qa", _f("qa/hotpotqa_dev_full_qa.json", 1039779,
                               "5f840eb93158c2f8875dda07646c3ca6714507d63b93def54632b07620263096"),
          7405, "CC BY-SA 4.0",
          "https://github.com/chenyiqun/Agentic-RAG/blob/a6694e2e/data/hotpot_qa/"
          "hotpotqa_test_questions_and_answers.json"),
    Entry("2wikimultihopqa", "qa", _f("qa/2wikimultihopqa_dev_full_qa.json", 1458596,
                                      "85cbe1019b2bd96ca2c0790711fefa47bfa5a564fe881bcf39017dd09e9a9e8d"),
          12576, "Apache-2.0",

          "https://github.com/chenyiqun/Agentic-RAG/blob/a6694e2e/data/2wikimultihop_qa/"
          "2wikimultihop_test_questions_and_answers.json"),
    Entry("musique", "qa", _f("qa/musique_dev_full_qa.json", 364482,
                              "6c7723e9f4539a552c7f5ae26a1ca9131f0f9ab7efb1b47409652f0c99fda7da"),
          2417, "CC BY 4.0",
          "https://github.com/chenyiqun/Agentic-RAG/blob/a6694e2e/data/musique/"
          "musique_test_questions_and_answers.json"),
    Entry("searchr1_nq_test", "qa", _f("qa/searchr1_nq_search_test.parquet", 617522,
                                       "c31d75875e68d29a2c01ed5f68555ecff278d8151f7e77544e1c1fd04513d59a"),
          3610, "Apache-2.0", "https://github.com/tehranixyz/Search-R1/blob/b791f5d9/data/nq_search/test.parquet"),
    Entry("searchr1_nq_train", "qa", _f("qa/searchr1_nq_search_train5000.parquet", 774979,
                                        "5c83b883d637f17b1988517b3858f05eb99bf2d4b9e2173db162735c98956491"),
          5000, "Apache-2.0", "https://github.com/tehranixyz/Search-R1/blob/d519535c/data/nq_search/train.parquet"),
    Entry("hotpotqa_train100", "qa", _f("corpus/hipporag_hotpotqa_train100.json", 810836,
                                        "6c0e2689d03c94b3bb4d5f94ed806ea4f4eb4f46c12132f8e91df774ad5c5a22"),
          100, "MIT", "https://github.com/OSU-NLP-Group/HippoRAG/blob/3d95d255/data/hotpotqa_train.json",
          notes="100 HotpotQA questions; their contexts' passages are hotpotqa_train100_corpus"),
    Entry("hotpotqa_train100_corpus", "corpus", _f("corpus/hipporag_hotpotqa_train100_corpus.json", 640159,
                                                   "2671af600095eabc5b3f3bc3728861682f14fcced84ef1386509a8ae92647f88"),
          994, "MIT", "https://github.com/OSU-NLP-Group/HippoRAG/blob/3d95d255/data/hotpotqa_train_corpus.json"),
    Entry("wiki18_sample1000", "corpus", _f("corpus/flashrag_wiki18_sample1000.jsonl", 677910,
                                            "4ff49380c38844c413c5d022e9c269b21a00726130f561b518600f2beb7cc6ed"),
          1000, "MIT",
          "https://github.com/RUC-NLPIR/FlashRAG/blob/adb2a8bc/examples/quick_start/indexes/sample_data.jsonl"),
    Entry("searchr1_example_corpus", "corpus", _f("corpus/searchr1_example_corpus.jsonl", 6399,
                                                  "68b4ff871e19da6e63610517f5af253f118cce301b4d90a6ae007d0a86976491"),
          10, "Apache-2.0", "https://github.com/PeterGriffinJin/Search-R1/blob/a14dc3a4/example/corpus.jsonl"),
    Entry("2wikimultihopqa_corpus", "corpus", _f("corpus/hipporag_2wikimultihopqa_corpus.json", 3083943,
                                                 "9d6e352952aafb18dab22bf8195039461321a44a949df902ae83bce134ad238a"),
          6119, "MIT",
          "https://github.com/OSU-NLP-Group/HippoRAG/blob/c617143f/reproduce/dataset/2wikimultihopqa_corpus.json"),
    Entry("rlfocal_bbh", "ensembles", (
        DataFile("ensembles/rlfocal_bbh/bbh.jsonl", 6129427,
                 "cf0c88e9ca27b7cd70d07c84f1a08b6c2fb8c8983fc8239e359022249121c8bc"),
        DataFile("ensembles/rlfocal_bbh/bbh_data_raw_06ae807.meta.json", 1331,
                 "edfcde29981e1c83c9282614b69a54174aa816a1d6fd9317715cb9b217b33f66"),
        DataFile("ensembles/rlfocal_bbh/bbh_data_raw_06ae807.npz", 599548,
                 "782632df76a065a558d38d20296393d2901d16dd12eec803eb2347b43458d57d")),
          5761, "see ensembles/README.md", "RL-Focal's BBH predictions of 5 models (ensembles/README.md)"),
    Entry("routerdc_7models", "ensembles", tuple(DataFile(f"ensembles/routerdc_7models/{n}.jsonl", b, s) for n, b, s in [
        ("arc_challenge", 885216, "499b110c67b80034cde5ee82d3398009b4c3435618ab690de0a53f4b1b97309c"),
        ("arc_easy", 1793627, "6c633b7b49a7f1ed888d3055d2084ccbc209917dafd9b8c5f33acfc4a609309f"),
        ("ceval", 1003504, "9a4bd25d679c231ccf3ac960502b8f5da81f98b74536be62421866884d38980b"),
        ("cmmlu", 4092377, "bccf2c5c87479e29fc41161bbdd5ba4b2ac9aeac26d177bcbdc124dd0dbb8e41"),
        ("gsm8k", 1722797, "05e4fd92d5662b99ba8982e99744cce5f17f31d131fed40cf0d57e24816fc771"),
        ("humaneval", 122405, "adc73f16a5c546ffd5012fb03c1c0c111c1b1b78292a1d3a32c2e2083b4c3a2f"),
        ("humanevalpack_js", 122234, "3cade09531f09bd146fafad02862f8d501f6029325fe81489c83473405ea951c"),
        ("math_prealgebra", 654011, "93eeb428643ec050826c0af012cee532fcd5bf107fa20965cfddd15b0b2c6c4b"),
        ("mbpp", 369890, "a740793b4f7a30159a106f2bce16ffa0ee745025d285b427873fd6330d967cde"),
        ("mmlu", 4655108, "0b20dfe3d0c3fafbaa8888424320a9dedfe93412d200da5d9952dfdaa7dcfabd")]),
          0, "see ensembles/README.md", "RouterDC's correctness tables of 7 models (ensembles/README.md)",
          notes="10 benchmark files"),
    Entry("ensemble_stats", "ensembles", _f("ensembles/stats.json", 55956,
                                            "df02b23788918dc8bd6eb1d4f16a3ce32f598ca3f992ff6d83c9345d26b416e2"),
          0, "see ensembles/README.md", "statistics of the ensemble data (ensembles/README.md)"),
]}

_BY_FILE = {f.rel: e for e in CATALOG.values() for f in e.files}


# --------------------------------------------------------------------------------------------
# finding files


def entry(name: str) -> Entry:
    if name not in CATALOG:
        raise DataError(f"unknown data set {name!r}; known: {', '.join(sorted(CATALOG))} (masrl data list)")
    return CATALOG[name]


def find(rel: str) -> Optional[Path]:
    """The first data folder that holds ``rel`` (a path under a data folder), or None."""
    for root in data_roots():
        if (root / rel).is_file():
            return root / rel
    return None


def resolve(text: str | os.PathLike) -> Path:
    """A file the user named: an existing path as it is; else a catalogue name of one file, or a path under
    a data folder (``corpus/x.jsonl``), in the first data folder that holds it; else the path as given
    (its reader then reports it missing)."""
    path = Path(text).expanduser()
    if path.exists() or path.is_absolute():
        return path
    e = CATALOG.get(str(text))
    if e is not None and len(e.files) == 1:
        return find(e.files[0].rel) or path
    return find(str(text)) or path


def get_hint(rel: str) -> str:
    """What to run to get the file ``rel``: the ``masrl data get`` line, or where to put it."""
    e = _BY_FILE.get(rel)
    where = " or ".join(str(r) for r in data_roots())
    if e is None:
        return f"looked in {where} (set MASRL_DATA_DIR to the folder that holds it)"
    how = f"masrl data get {e.name}" if e.hub else f"masrl data get {e.name} --from FILE_OR_URL"
    return f"looked in {where}; run `{how}` (source: {e.source}) or set MASRL_DATA_DIR"


def require(rel: str, what: str = "data file") -> Path:
    """The path of ``rel`` in the first data folder that holds it; one clear error naming the fix if none."""
    path = find(rel)
    if path is None:
        raise DataNotFoundError(f"{what} {rel} not found: {get_hint(rel)}")
    return path


# --------------------------------------------------------------------------------------------
# checking


def _json_lines(path: Path, gz: bool) -> Iterable[str]:
    opener = gzip.open if gz else open
    with opener(path, "rt", encoding="utf-8-sig") as f:
        for line in f:
            if line.strip():
                yield line


def check_file(e: Entry, f: DataFile, path: Path) -> tuple[str, str]:
    """``("verified", "")`` when the SHA-256 matches the reference; ``("converted", ...)`` for a Hub
    conversion with the expected rows and fields; else ``("bad", reason)``."""
    if path.stat().st_size == f.bytes and sha256_file(path) == f.sha256:
        return "verified", ""
    if e.hub is None or len(e.files) != 1:
        return "bad", f"SHA-256 differs from the reference copy ({f.sha256[:16]}..., {f.bytes:,} bytes)"
    n = 0
    try:
        for n, line in enumerate(_json_lines(path, f.rel.endswith(".gz")), 1):
            row = json.loads(line)
            missing = [k for k in e.hub.fields if not isinstance(row, dict) or k not in row]
            if missing:
                return "bad", f"row {n} lacks field(s) {', '.join(missing)}"
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as err:
        return "bad", f"cannot read it as JSON lines ({type(err).__name__}: {str(err)[:120]})"
    if n != e.rows:
        return "bad", f"{n:,} rows, expected {e.rows:,}"
    return "converted", f"{n:,} rows with the expected fields; bytes differ from the reference copy"


def verify(names: Sequence[str] = ()) -> list[tuple[str, str, str, str]]:
    """(name, file, status, detail) for every file of the named entries (all when none are named);
    status is verified / converted / bad / missing."""
    out = []
    for name in names or sorted(CATALOG):
        e = entry(name)
        for f in e.files:
            path = find(f.rel)
            if path is None:
                out.append((e.name, f.rel, "missing", get_hint(f.rel)))
            else:
                status, detail = check_file(e, f, path)
                out.append((e.name, str(path), status, detail))
    return out


# --------------------------------------------------------------------------------------------
# getting


def _install(tmp: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, dest)


def _tmp_for(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest.with_name(f".{dest.name}.part-{os.getpid()}")


def _download(url: str, tmp: Path, limit: int) -> None:
    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_S) as r, open(tmp, "wb") as out:  # noqa: S310 - http(s) only
            total = 0
            while block := r.read(1 << 20):
                total += len(block)
                if total > limit:
                    raise DataError(f"{url}: more than {limit:,} bytes; not the expected file")
                out.write(block)
    except DataError:
        raise
    except (OSError, ValueError) as err:
        raise DataError(f"cannot download {url}: {type(err).__name__}: {str(err)[:200]}") from None


def _copy_from(e: Entry, f: DataFile, source: str, tmp: Path) -> None:
    scheme = urllib.parse.urlparse(source).scheme
    if scheme in ("http", "https"):
        _download(source, tmp, MAX_DOWNLOAD_FACTOR * f.bytes + (1 << 20))
        return
    if scheme not in ("", "file") and len(scheme) > 1:  # one letter: a Windows drive
        raise DataError(f"--from {source}: give a local file or an http(s) URL")
    path = Path(urllib.parse.urlparse(source).path if scheme == "file" else source).expanduser()
    if path.is_dir():
        path = path / f.rel if (path / f.rel).is_file() else path / Path(f.rel).name
    if not path.is_file():
        raise DataError(f"--from {source}: no such file (for {e.name}: {f.rel})")
    shutil.copyfile(path, tmp)


def _hub_rows(hub: HubSource, load_dataset: Callable[..., Any]) -> list[dict]:
    rows: list[dict] = []
    for split in hub.splits:
        try:
            ds = load_dataset(hub.repo, hub.config, split=split) if hub.config else load_dataset(hub.repo, split=split)
        except Exception as err:  # noqa: BLE001 - datasets raises many kinds (offline, not found, auth)
            raise DataError(f"cannot fetch {hub.repo} split {split} from the Hugging Face Hub "
                            f"({type(err).__name__}: {str(err)[:200]}); offline, give --from FILE_OR_URL") from None
        for row in ds:
            missing = [k for k in hub.fields if k not in row]
            if missing:
                raise DataError(f"{hub.repo} split {split}: rows lack field(s) {', '.join(missing)}")
            rows.append({k: row[k] for k in hub.fields})
    if hub.sort_key:
        rows.sort(key=lambda r: r[hub.sort_key])
    return rows


def _write_rows(rows: list[dict], tmp: Path, gz: bool) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(tmp, "wb") as f:
            f.write(text.encode("utf-8"))
    else:
        tmp.write_text(text, encoding="utf-8")


HUB_PROBE_S = 5.0  # seconds the Hub gets to answer before a fetch is given up (one line, no retries)


def check_hub(timeout: float = HUB_PROBE_S) -> None:
    """One request to the Hugging Face Hub (``$HF_ENDPOINT``, default huggingface.co) before a fetch: when it does
    not answer, one ``DataError`` line now instead of ``datasets``' retries (tens of seconds of log lines). Skipped
    under ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` (the local cache answers then)."""
    if any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes") for k in
           ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{endpoint}/api/whoami-v2", method="HEAD"),
                                    timeout=timeout):
            pass
    except urllib.error.HTTPError:  # it answered (401 without a token): reachable
        return
    except (OSError, ValueError) as err:  # URLError, a timeout, a refused connection, a malformed endpoint
        reason = getattr(err, "reason", err)
        raise DataError(f"the Hugging Face Hub ({endpoint}) cannot be reached ({reason}); connect to the network, "
                        "or download the file yourself and give --from FILE_OR_URL") from None


def _default_load_dataset() -> Callable[..., Any]:
    try:
        from datasets import load_dataset
    except ImportError:
        raise missing_extra("fetching from the Hugging Face Hub needs the `datasets` library (or give --from "
                            "FILE_OR_URL)", "hf") from None
    return load_dataset


def get(name: str, source: Optional[str] = None, *, force: bool = False, dest_root: Optional[Path] = None,
        load_dataset: Optional[Callable[..., Any]] = None) -> list[tuple[Path, str, str]]:
    """Install entry ``name`` into ``dest_root`` (default: the download folder) and check it.

    ``source``: a local file, a folder holding the file(s), or an http(s) URL; None fetches from the
    Hugging Face Hub (entries with a Hub source). A file that fails the check is not kept. Returns
    (path, status, detail) per file; files already present and verified are left alone unless ``force``.
    """
    e = entry(name)
    root = dest_root or download_dir()
    if source is None and e.hub is None:
        raise DataError(f"{name} has no Hub source masrl can convert exactly; get it from {e.source} and run "
                        f"`masrl data get {name} --from FILE_OR_URL`")
    if source is not None and len(e.files) > 1 and urllib.parse.urlparse(source).scheme in ("http", "https"):
        raise DataError(f"{name} has {len(e.files)} files; give --from a folder that holds them")
    done = []
    for f in e.files:
        dest = root / f.rel
        if dest.is_file() and not force:
            status, detail = check_file(e, f, dest)
            if status != "bad":
                done.append((dest, status, f"already there{'; ' + detail if detail else ''}"))
                continue
        if source is None and load_dataset is None:
            load_dataset = _default_load_dataset()  # the hf extra first, then the network
            check_hub()  # before anything is written: an unreachable Hub leaves no folder behind
        tmp = _tmp_for(dest)
        try:
            if source is None:
                _write_rows(_hub_rows(e.hub, load_dataset), tmp, f.rel.endswith(".gz"))
            else:
                _copy_from(e, f, source, tmp)
            status, detail = check_file(e, f, tmp)
            if status == "bad":
                raise DataError(f"{name}: the fetched {Path(f.rel).name} is not the expected file: {detail}; "
                                "nothing was installed")
            _install(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        done.append((dest, status, detail))
    return done


def download_dir() -> Path:
    """Where ``masrl data get`` writes: ``$MASRL_DATA_DIR`` when set, else the user data folder."""
    return data_dir() if os.environ.get("MASRL_DATA_DIR") else user_data_dir()


# --------------------------------------------------------------------------------------------
# the command's text


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def list_text() -> str:
    roots = data_roots()
    lines = ["data folders, in the order masrl looks: " + ", ".join(str(r) for r in roots),
             f"`masrl data get` writes to: {download_dir()}", "",
             f"{'name':<24} {'kind':<9} {'size':>8}  {'where':<10} {'get':<5} licence"]
    for e in sorted(CATALOG.values(), key=lambda e: (e.kind, e.name)):
        found = [find(f.rel) for f in e.files]
        where = "missing" if not any(found) else ("present" if all(found) else "partial")
        lines.append(f"{e.name:<24} {e.kind:<9} {_mb(e.size):>8}  {where:<10} {'hub' if e.hub else 'file':<5} "
                     f"{e.licence}")
    lines += ["", "get: 'hub' = `masrl data get NAME` converts it from the Hugging Face Hub; 'file' = "
              "`masrl data get NAME --from FILE_OR_URL` (the source is in `masrl data path NAME`)."]
    return "\n".join(lines)


def path_text(name: str) -> tuple[str, bool]:
    e = entry(name)
    lines, ok = [], True
    for f in e.files:
        p = find(f.rel)
        ok &= p is not None
        lines.append(str(p) if p else f"{f.rel}: not found; {get_hint(f.rel)}")
    lines.append(f"# {e.name}: {e.kind}, {e.rows:,} rows, {e.licence}; source {e.source}" if e.rows else
                 f"# {e.name}: {e.kind}, {e.licence}; source {e.source}")
    return "\n".join(lines), ok


# --------------------------------------------------------------------------------------------
# `masrl data` (registered by masrl.cli)


def _cmd_list(args) -> int:
    print(list_text())
    return 0


def _cmd_path(args) -> int:
    text, ok = path_text(args.name)
    print(text)
    return 0 if ok else 1


def _cmd_verify(args) -> int:
    rows = verify(args.names)
    bad = [r for r in rows if r[2] == "bad" or (args.names and r[2] == "missing")]
    for name, where, status, detail in rows:
        if status != "missing" or args.names:
            print(f"{status:<9} {name:<24} {where}{'  (' + detail + ')' if detail else ''}")
    missing = sum(r[2] == "missing" for r in rows)
    print(f"{sum(r[2] == 'verified' for r in rows)} verified, {sum(r[2] == 'converted' for r in rows)} converted, "
          f"{sum(r[2] == 'bad' for r in rows)} bad, {missing} missing (masrl data list)")
    return 1 if bad else 0


def _cmd_get(args) -> int:
    dest = Path(args.dir).expanduser() if args.dir else download_dir()
    check_output_dir(dest, "--dir" if args.dir else "data folder ($MASRL_DATA_DIR or the user data folder)")
    for path, status, detail in get(args.name, args.source, force=args.force, dest_root=dest):
        print(f"{status:<9} {path}{'  (' + detail + ')' if detail else ''}")
    return 0


def register(sub) -> None:
    """``masrl data list | path NAME | verify [NAME ...] | get NAME [--from FILE_OR_URL]``."""
    data = sub.add_parser("data", help="benchmark data: list what masrl knows, where it is, verify it, get it")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    ls = data_sub.add_parser("list", help="every data set masrl reads, whether it is present, size, licence")
    ls.set_defaults(func=_cmd_list)
    path = data_sub.add_parser("path", help="where a data set's files are (exit 1 if absent)")
    path.add_argument("name")
    path.set_defaults(func=_cmd_path)
    ver = data_sub.add_parser("verify", help="check files against the reference SHA-256 (exit 1 on a bad file)")
    ver.add_argument("names", nargs="*", help="data sets (default: every one present)")
    ver.set_defaults(func=_cmd_verify)
    get_p = data_sub.add_parser("get", help="fetch a data set from the Hugging Face Hub or a file/URL you give")
    get_p.add_argument("name")
    get_p.add_argument("--from", dest="source", metavar="FILE_OR_URL", default=None,
                       help="a local file, a folder holding it, or an http(s) URL (default: the Hub, where masrl "
                            "has an exact conversion)")
    get_p.add_argument("--dir", default=None, help="data folder to write to (default: $MASRL_DATA_DIR, else the "
                                                   "user data folder)")
    get_p.add_argument("--force", action="store_true", help="fetch again even if a good copy is there")
    get_p.set_defaults(func=_cmd_get)
