"""Tests of draftcert.report: write_report / `draftcert report` on synthetic traces, figures, HTML."""
