"""report.html renders the report's markdown (emphasis), not its raw asterisks."""

from __future__ import annotations

import re

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
