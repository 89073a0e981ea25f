"""The one row reader (masrl.io.rows): positions, reporting, strict, limit, formats."""
import json
import warnings

import pytest

from masrl.io.rows import (MAX_SHOWN, BadRow, MalformedRowError, MalformedRowWarning, RowPos, iter_records,
                              read_rows)


def _parse(obj, pos):
    if "q" not in obj:
        raise BadRow("missing field 'q'")
    if obj.get("skip"):
        return None  # left out silently (e.g. another split)
    return (pos.index, pos.line, obj["q"])


def _read(path, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, report = read_rows(path, _parse, **kw)
    return values, report, [str(w.message) for w in caught if w.category is MalformedRowWarning]


def test_jsonl_positions_reasons_and_silent_skips(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([json.dumps({"q": "a"}), "{oops", "", json.dumps([1]), json.dumps({"x": 1}),
                               json.dumps({"q": "s", "skip": True}), json.dumps({"q": "b"})]) + "\n")
    values, report, msgs = _read(path)
    # index counts non-blank lines (ids stay stable when rows are skipped), line is the file's line
    assert values == [(0, 1, "a"), (5, 7, "b")]
    assert msgs == [f"{path}:2: invalid JSON (Expecting property name enclosed in double quotes at column 2); "
                    "row skipped",
                    f"{path}:4: expected a JSON object, got list; row skipped",
                    f"{path}:5: missing field 'q'; row skipped"]
    assert report.rows == 6 and report.kept == 2 and [w for w, _ in report.skipped] == ["2", "4", "5"]
    assert report.describe() == f"{path}: 2 rows kept, 3 skipped"


def test_strict_stops_at_first_bad_row_with_file_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "a"}) + "\n\n" + json.dumps({"x": 1}) + "\n{oops\n")
    with pytest.raises(MalformedRowError, match=rf"^{path}:3: missing field 'q'$"):
        read_rows(path, _parse, strict=True)
    assert issubclass(MalformedRowError, ValueError)

    class MyError(ValueError):
        pass

    with pytest.raises(MyError, match=rf"{path}:3:"):
        read_rows(path, _parse, strict=True, error=MyError)


def test_many_bad_rows_warn_a_few_then_count_once(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"x": i}) + "\n" for i in range(MAX_SHOWN + 5)) + json.dumps({"q": 1}) + "\n")
    values, report, msgs = _read(path)
    assert len(values) == 1 and len(report.skipped) == MAX_SHOWN + 5
    assert len(msgs) == MAX_SHOWN + 1
    assert msgs[-1] == f"{path}: skipped {MAX_SHOWN + 5} malformed rows in all"


def test_limit_stops_reading(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "a"}) + "\n" + json.dumps({"q": "b"}) + "\n{oops\n")
    values, report, msgs = _read(path, limit=2)
    assert [v[2] for v in values] == ["a", "b"] and msgs == [] and report.rows == 2  # the bad row is never read
    assert _read(path, limit=0)[0] == []


def test_json_array_parquet_and_gz(tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    arr = tmp_path / "d.json"
    arr.write_text(json.dumps([{"q": "a"}, "x", {"x": 1}]))
    values, _, msgs = _read(arr)
    assert values == [(0, None, "a")]
    assert msgs[0].startswith(f"{arr}:index 1: expected a JSON object, got str")
    assert msgs[1].startswith(f"{arr}:index 2: missing field 'q'")
    table = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "a", "x": 0}, {"q": None, "x": 1}]), table)
    values, _, _ = _read(table)
    assert [v[2] for v in values] == ["a", None]
    gz = tmp_path / "d.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"q": "z"}) + "\n")
    assert _read(gz)[0] == [(0, 1, "z")]


def test_whole_file_errors(tmp_path):
    obj = tmp_path / "o.json"
    obj.write_text('{"q": 1}')
    with pytest.raises(MalformedRowError, match="expected a JSON array"):
        read_rows(obj, _parse)
    bad = tmp_path / "b.json"
    bad.write_text('[{"q": ')
    with pytest.raises(MalformedRowError, match=rf"{bad}:1: invalid JSON"):
        read_rows(bad, _parse)
    with pytest.raises(FileNotFoundError, match="data file not found"):
        read_rows(tmp_path / "missing.jsonl", _parse)
    with pytest.raises(ValueError, match="cannot tell the row format"):
        list(iter_records(tmp_path / "x.csv"))


def test_blank_lines_as_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "a"}) + "\n\n")
    assert [(p, type(o).__name__) for p, o in iter_records(path, blank_lines_are_rows=True)][1][0] == RowPos("2", 1, 2)
    _, report, msgs = _read(path, blank_lines_are_rows=True)
    assert report.skipped == [("2", "empty line")]


def test_every_loader_uses_the_one_warning_class():
    from masrl.ensemble import MalformedRowWarning as ensemble_w
    from masrl.tasks.code import MalformedRowWarning as code_w
    from masrl.tasks.math_data import MalformedRowWarning as math_w
    from masrl.tasks.qa import QADataWarning
    from masrl.retrieval import CorpusWarning

    assert {ensemble_w, code_w, math_w, QADataWarning, CorpusWarning} == {MalformedRowWarning}
