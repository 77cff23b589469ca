"""A benchmark's latest recorded run, kept as bench/results/latest/<name>.json,
and bench/RESULTS.md, rendered from those records.

A benchmark that records a run builds its markdown section as before
(`## <title>, <date>`, the command in backticks, then paragraphs and tables)
and hands it to `record_run`, which parses it into a `RunRecord` (the
paragraphs as text, the tables as columns and rows), adds what the bench
measured in numbers (its rows, the load average, the machine's floors), saves
it over the benchmark's previous record and renders bench/RESULTS.md again
from every record. `python -m bench.catalog --write` renders it too, and
tests/bench/test_results.py fails when bench/RESULTS.md is not what
`render_results` makes of the records.

The runs recorded before this existed were migrated from the markdown history
once: their records say so in `provenance`.
"""

from __future__ import annotations

import datetime
import enum
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_MD = os.path.join(BENCH_DIR, "RESULTS.md")
RECORDS_DIR = os.path.join(BENCH_DIR, "results", "latest")
HISTORY = "results/history/RESULTS-2026-11-29-to-2026-12-02.md"  # relative to bench/
# the packages' order in bench/README.md's table and in bench/RESULTS.md; others after them, by name
PACKAGE_ORDER = ["serving", "micro", "plots"]


def package_key(package: str) -> tuple[int, str]:
    return (PACKAGE_ORDER.index(package) if package in PACKAGE_ORDER else len(PACKAGE_ORDER), package)


class BlockKind(str, enum.Enum):
    TEXT = "text"    # a paragraph, list or sub-heading, as markdown
    TABLE = "table"  # a markdown table: header cells and rows of cells


@dataclass
class Block:
    kind: BlockKind
    text: str = ""
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        if self.kind is BlockKind.TEXT:
            return {"kind": self.kind.value, "text": self.text}
        return {"kind": self.kind.value, "columns": self.columns, "rows": self.rows}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Block:
        kind = BlockKind(d["kind"])
        if kind is BlockKind.TEXT:
            return cls(kind, text=d["text"])
        return cls(kind, columns=list(d["columns"]), rows=[list(r) for r in d["rows"]])

    def render(self) -> str:
        if self.kind is BlockKind.TEXT:
            return self.text
        lines = [table_line(self.columns), "|" + "---|" * len(self.columns)]
        return "\n".join(lines + [table_line(r) for r in self.rows])


@dataclass
class LoadAverage:
    """os.getloadavg() at the start and at the end of the run (1, 5, 15 min),
    or only the 1-minute figure where that is all the bench kept."""
    start: list[float] | None = None
    end: list[float] | None = None


@dataclass
class RunRecord:
    bench: str     # the module: bench.micro.step_bench
    title: str     # the section's heading, without the date
    date: str      # when it ran: 2026-12-02
    command: str   # as it was run
    body: list[Block]
    load_average: LoadAverage | None = None
    floors: dict[str, float] | None = None  # the machine's rates the bench measured for its floors
    data: Any = None                        # the bench's rows, as numbers, where it keeps them
    provenance: str | None = None           # set on a run migrated from the markdown history
    # one of several records a bench keeps (bench.serving.peers, one per model): its file is
    # <name>-<label>.json, beside the unlabelled one
    label: str | None = None

    @property
    def name(self) -> str:
        base = self.bench.rsplit(".", 1)[-1]
        return f"{base}-{self.label}" if self.label else base

    def to_json(self) -> dict[str, Any]:
        return {"bench": self.bench, "title": self.title, "date": self.date, "command": self.command,
                "provenance": self.provenance,
                "load_average": None if self.load_average is None else
                {"start": self.load_average.start, "end": self.load_average.end},
                "floors": self.floors, "body": [b.to_json() for b in self.body], "data": self.data,
                **({"label": self.label} if self.label else {})}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunRecord:
        load = d.get("load_average")
        return cls(d["bench"], d["title"], d["date"], d["command"], [Block.from_json(b) for b in d["body"]],
                   None if load is None else LoadAverage(load.get("start"), load.get("end")),
                   d.get("floors"), d.get("data"), d.get("provenance"), d.get("label"))

    def render(self) -> str:
        parts = [f"## {self.title}, {self.date}"]
        if self.provenance:
            parts.append(f"_{self.provenance}_")
        parts.append(f"`{self.command}`")
        return "\n\n".join(parts + [b.render() for b in self.body])


CELL_SPLIT = re.compile(r"(?<!\\)\|")


def table_line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table_cells(line: str) -> list[str]:
    return [c.strip() for c in CELL_SPLIT.split(line.strip())[1:-1]]


def parse_blocks(markdown: str) -> list[Block]:
    """Paragraphs (separated by blank lines) and tables (runs of lines that
    start with `|`: header, separator, rows)."""
    blocks: list[Block] = []
    lines = markdown.strip("\n").splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
        elif lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            table = lines[i:j]
            blocks.append(Block(BlockKind.TABLE, columns=table_cells(table[0]),
                                rows=[table_cells(r) for r in table[2:]]))
            i = j
        else:
            j = i
            while j < len(lines) and lines[j].strip() and not lines[j].startswith("|"):
                j += 1
            blocks.append(Block(BlockKind.TEXT, text="\n".join(line.rstrip() for line in lines[i:j])))
            i = j
    return blocks


HEADING = re.compile(r"^## (?P<title>.*), (?P<date>\d{4}-\d{2}(?:-\d{2})?)$")
COMMAND = re.compile(r"^`(?P<command>.*)`$")


def from_markdown(section: str, bench: str, **fields: Any) -> RunRecord:
    """A record of the section a bench renders: `## <title>, <date>`, a blank
    line, the command in backticks, then the body."""
    text = section.strip("\n")
    first, _, rest = text.partition("\n")
    heading = HEADING.match(first.strip())
    if heading is None:
        raise ValueError(f"not a dated section heading: {first!r}")
    blocks = parse_blocks(rest)
    command = COMMAND.match(blocks[0].text) if blocks and blocks[0].kind is BlockKind.TEXT else None
    if command is None:
        raise ValueError(f"{bench}: the section does not start with its command in backticks")
    return RunRecord(bench, heading["title"], heading["date"], command["command"], blocks[1:], **fields)


# The paths below default to the module's RECORDS_DIR and RESULTS_MD as they are
# when called, so that a test can point a benchmark's recording elsewhere.

def record_path(name: str, records_dir: str | None = None) -> str:
    return os.path.join(records_dir or RECORDS_DIR, f"{name}.json")


def save(record: RunRecord, records_dir: str | None = None) -> str:
    path = record_path(record.name, records_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record.to_json(), f, indent=1, ensure_ascii=False)
        f.write("\n")
    return path


def load_all(records_dir: str | None = None) -> list[RunRecord]:
    """Every record, in bench/README.md's order (package, then module)."""
    records_dir = records_dir or RECORDS_DIR
    records = []
    if os.path.isdir(records_dir):
        for name in sorted(os.listdir(records_dir)):
            if name.endswith(".json"):
                with open(os.path.join(records_dir, name)) as f:
                    records.append(RunRecord.from_json(json.load(f)))

    def key(r: RunRecord) -> tuple[tuple[int, str], str]:
        package = r.bench.split(".")[1] if r.bench.count(".") >= 2 else ""
        return package_key(package), r.bench
    return sorted(records, key=key)


HEADER = f"""\
# Benchmark results

<!-- Generated by `python -m bench.catalog --write` from bench/results/latest/*.json: do not edit this file. -->

One section per benchmark: its latest recorded run, rendered from its record
`bench/results/latest/<benchmark>.json` (the command, the date, the load
average and the floors it measured, its rows). A benchmark that records a run
(see [README.md](README.md)) replaces its record and renders this file again.

Every run recorded before that, in the order it was appended, is in
[{HISTORY}]({HISTORY});
the hand-written analyses that sat between the runs are in
[docs/performance.md](../docs/performance.md). A section whose record was
migrated from that history says so under its heading: it was not re-run, its
command is the one run then (before bench/ was split into packages: the module
`bench.step_bench` is now `bench.micro.step_bench`, and so on), and where the
benchmark prints to stdout only, its text was written by hand when it ran.
"""


def render_results(records: list[RunRecord]) -> str:
    return HEADER + "".join("\n" + r.render() + "\n" for r in records)


def write_results(records_dir: str | None = None, results_md: str | None = None) -> str:
    text = render_results(load_all(records_dir))
    with open(results_md or RESULTS_MD, "w") as f:
        f.write(text)
    return text


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def today() -> str:
    return datetime.date.today().isoformat()


def record_run(section: str, bench: str, *, data: Any = None, load_average: LoadAverage | None = None,
               floors: dict[str, float] | None = None, records_dir: str | None = None,
               results_md: str | None = None, label: str | None = None) -> RunRecord:
    """Records a run: its section becomes bench/results/latest/<name>.json
    (replacing the benchmark's previous record of that label) and
    bench/RESULTS.md is rendered again from every record."""
    record = from_markdown(section, bench, load_average=load_average, floors=floors, data=data, label=label)
    save(record, records_dir)
    write_results(records_dir, results_md)
    return record
