"""bench/serving/lm_eval_formats.py's report: each format's score deltas
against the reference and the items whose answer moved, as a section
bench/RESULTS.md's records parse (the servers and lm-eval are not run here)."""

from __future__ import annotations

from bench.lib.run_record import BlockKind, from_markdown
from bench.serving.lm_eval_formats import FORMATS, Scores, report


def test_the_report_gives_each_format_its_deltas_and_moved_answers() -> None:
    ref = Scores(acc=1.0, choices=[[-1.0, -3.0], [-2.0, -5.0, -4.0]], chosen=[0, 0])
    # the first item's answer moves (-3.5 < -2.5 now), the second's does not
    moved = Scores(acc=0.5, choices=[[-3.5, -2.5], [-2.0, -5.25, -4.0]], chosen=[1, 0])
    same = Scores(acc=1.0, choices=[[-1.0, -3.0], [-2.0, -5.0, -4.0]], chosen=[0, 0])
    text = report("python -m bench.serving.lm_eval_formats", ref,
                  [(FORMATS[0], moved, 12.0), (FORMATS[1], same, 9.0)], ([0.1, 0.2, 0.3], [0.4, 0.5, 0.6]))
    record = from_markdown(text, "bench.serving.lm_eval_formats")
    [table] = [b for b in record.body if b.kind is BlockKind.TABLE]
    rows = {r[0]: r for r in table.rows}
    col = {name: i for i, name in enumerate(table.columns)}
    assert rows[FORMATS[0].name][col["largest abs delta"]] == "2.5000"
    assert rows[FORMATS[0].name][col["mean abs delta"]] == f"{(2.5 + 0.5 + 0.25) / 5:.4f}"
    assert rows[FORMATS[0].name][col["items choosing otherwise"]] == "1 of 2"
    assert rows[FORMATS[1].name][col["largest abs delta"]] == "0.0000"
    assert rows[FORMATS[1].name][col["items choosing otherwise"]] == "0 of 2"
    assert "python -m bench.serving.lm_eval_formats" == record.command
