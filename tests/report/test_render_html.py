"""report.html renders the report's markdown (emphasis, inline code), never its raw asterisks or
backticks; its table cells read on one line and a rate of few tries shows its counts."""

from __future__ import annotations

import json
import re

import pytest

from draftcert.replay.speed_figures import MIN_TRIES
from draftcert.replay.report_section import section_for_report
from draftcert.report import write_report
from draftcert.report.render import HOW_TO_READ, markdown_to_html

from . import tracegen


def test_markdown_to_html_emphasis_and_escaping():
    assert markdown_to_html("the *radius* of p") == "<p>the <em>radius</em> of p</p>"
    assert markdown_to_html("a <b>x</b> >= 1") == "<p>a &lt;b&gt;x&lt;/b&gt; &gt;= 1</p>"  # no raw HTML through


def test_html_report_has_no_literal_asterisks(tmp_path):
    tracegen.write_run(tmp_path, tracegen.make_steps(seed=1, lengths=(9, 8, 9, 7)))
    write_report(tmp_path, verbose=False)
    html = (tmp_path / "report.html").read_text()
    body = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html)
    assert "*radius*" in HOW_TO_READ  # the source is markdown...
    assert "*" not in body  # ...and the page shows none of its asterisks
    assert "<em>radius</em>" in body and "<em>soundness violations</em>" in body
    assert "*radius*" in (tmp_path / "report.md").read_text()  # markdown stays markdown


@pytest.fixture(scope="module")
def with_replay(tmp_path_factory):
    """A report of an unfinished run (its note names a command in backticks) with a replay section:
    (its directory, summary.json's dict, report.html without its images)."""
    out = tmp_path_factory.mktemp("with-replay")
    tracegen.write_run(out, tracegen.make_steps(seed=1))
    run = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**run, "status": "running"}))
    summary = write_report(out, replay=section_for_report(out), verbose=False)
    html = (out / "report.html").read_text()
    return out, summary, re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html)


def test_html_report_has_no_markdown_left(with_replay):
    out, summary, body = with_replay
    assert "replay" in summary and "<h2>Replay</h2>" in body
    assert "`" not in body and "**" not in body
    assert "<code>draftcert decode</code>" in body  # the replay paragraph's inline code
    assert "<code>draftcert profile</code>" in body  # the note of the unfinished run
    assert "`draftcert decode`" in (out / "report.md").read_text()  # markdown stays markdown


def test_table_cells_do_not_wrap_and_rates_of_few_tries_show_their_counts(with_replay):
    _, summary, body = with_replay
    assert "td{white-space:nowrap}" in body  # a cell (a row of rates) reads on one line
    assert ".meta td{text-align:left;white-space:normal}" in body  # the run's metadata wraps
    rows = dict(re.findall(r"<tr><td>([^<]+)</td>((?:<td>[^<]*</td>)+)</tr>", body))
    few = 0
    for spec, rule in summary["replay"]["rules"].items():
        cells = re.findall(r"<td>([^<]*)</td>", rows[spec])
        want = []
        for rate, n in zip(rule["conditional_acceptance_rate_per_pos_k8"], rule["num_attempted_per_pos_k8"]):
            if rate is None:
                want.append("-")
            elif n < MIN_TRIES:
                want.append(f"{round(rate * n)}/{n}")
                few += 1
            else:
                want.append(f"{rate:.2f}")
        assert " ".join(want) in cells, (spec, cells)
    assert few  # the trace has positions tried only a few times
