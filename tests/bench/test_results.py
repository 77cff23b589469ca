"""bench/RESULTS.md is what bench/lib/run_record.py renders from the records in
bench/results/latest/, one per benchmark; and a recorded run replaces its
benchmark's record and renders the file again."""

from __future__ import annotations

import json
import os

from bench import catalog
from bench.lib import run_record
from bench.lib.run_record import BlockKind, LoadAverage

SECTION = """
## A benchmark's question, 2026-12-05

`python -m bench.micro.example --rows 1 2`

Machine: x86_64, 2 cores; load average 1.0 at the start.

| rows | ms | note |
|---|---|---|
| 1 | 10.0 | a \\| b |
| 2 | 12.5 | - |

- a list,
- kept as one paragraph

![a plot](results/example.png)
"""


def test_bench_results_md_is_what_the_records_render() -> None:
    with open(run_record.RESULTS_MD) as f:
        assert f.read() == run_record.render_results(run_record.load_all()), \
            "bench/RESULTS.md is stale: run python -m bench.catalog --write"


def test_every_record_belongs_to_a_runnable_benchmark_and_is_named_for_it() -> None:
    benches = {e.module for e in catalog.entries()}
    names = sorted(n for n in os.listdir(run_record.RECORDS_DIR) if n.endswith(".json"))
    assert len(names) >= 10
    for name in names:
        with open(os.path.join(run_record.RECORDS_DIR, name)) as f:
            raw = json.load(f)
        record = run_record.RunRecord.from_json(raw)
        assert record.bench in benches, f"{name}: {record.bench} is not a runnable benchmark"
        assert name == f"{record.name}.json"
        assert record.command.startswith("python -m bench.") and record.date.startswith("2026-")
        assert record.to_json() == raw  # nothing in the file that the record drops
        assert any(b.kind is BlockKind.TABLE for b in record.body) or record.provenance, name


def test_one_section_per_record_and_the_benchmarks_in_the_catalogs_order() -> None:
    records = run_record.load_all()
    order = [e.module for e in catalog.entries()]
    benches = [r.bench for r in records]
    # a benchmark's labelled records (another model, another mode) sit beside its unlabelled one
    grouped = [b for i, b in enumerate(benches) if i == 0 or benches[i - 1] != b]
    assert grouped == [m for m in order if m in set(benches)]
    assert len({(r.bench, r.label) for r in records}) == len(records)
    with open(run_record.RESULTS_MD) as f:
        headings = [line for line in f.read().splitlines() if line.startswith("## ")]
    assert len(headings) == len(records) == len(set(headings))


def test_a_section_parses_into_text_and_tables_and_renders_back() -> None:
    record = run_record.from_markdown(SECTION, "bench.micro.example")
    assert (record.title, record.date) == ("A benchmark's question", "2026-12-05")
    assert record.command == "python -m bench.micro.example --rows 1 2"
    kinds = [b.kind for b in record.body]
    assert kinds == [BlockKind.TEXT, BlockKind.TABLE, BlockKind.TEXT, BlockKind.TEXT]
    table = record.body[1]
    assert table.columns == ["rows", "ms", "note"]
    assert table.rows == [["1", "10.0", "a \\| b"], ["2", "12.5", "-"]]
    assert record.render() == SECTION.strip("\n")
    again = run_record.RunRecord.from_json(json.loads(json.dumps(record.to_json())))
    assert again.render() == record.render()


def test_recording_a_run_replaces_the_benchmarks_record_and_renders_results_again(tmp_path) -> None:
    records, results = str(tmp_path / "latest"), str(tmp_path / "RESULTS.md")
    run_record.record_run(SECTION, "bench.micro.example", data=[{"rows": 1, "ms": 10.0}],
                          load_average=LoadAverage([1.0, 0.5, 0.25], [1.5, 0.6, 0.3]),
                          floors={"read_bandwidth_gbs": 20.0}, records_dir=records, results_md=results)
    newer = SECTION.replace("2026-12-05", "2026-12-06").replace("12.5", "11.0")
    run_record.record_run(newer, "bench.micro.example", records_dir=records, results_md=results)
    run_record.record_run(SECTION.replace("bench.micro.example", "bench.serving.other"), "bench.serving.other",
                          records_dir=records, results_md=results)
    assert sorted(os.listdir(records)) == ["example.json", "other.json"]
    with open(os.path.join(records, "example.json")) as f:
        raw = json.load(f)
    assert raw["date"] == "2026-12-06" and raw["data"] is None and raw["load_average"] is None
    text = (tmp_path / "RESULTS.md").read_text()
    assert text == run_record.render_results(run_record.load_all(records))
    assert "| 2 | 11.0 | - |" in text and "| 2 | 12.5 | - |" not in text.split("## A benchmark's question, 2026-12-06")[1]
    # serving before micro, as in bench/README.md
    assert text.index("`python -m bench.serving.other") < text.index("`python -m bench.micro.example")
