"""What `reproduce-paper --check` checks, and a --limit above the prompt set's size (issue 31)."""

from __future__ import annotations

import pytest
import torch

from draftcert.cli import main
from draftcert.profile import paper
from draftcert.profile.settings import resolve_prompts
from draftcert.prompts import DATASETS_INSTALL, limit_note


@pytest.fixture
def all_but_datasets(monkeypatch):
    """A machine with the GPU and the hub the protocol needs, but without the `datasets` package."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(paper, "_hub_reachable", lambda repo, kind: (True, "in the local cache"))
    monkeypatch.setattr(paper, "datasets_missing", lambda: True)


def test_check_names_the_missing_datasets_package_and_how_to_install_it(all_but_datasets, capsys):
    assert main(["reproduce-paper", "--check"]) == paper.MISSING_STATUS
    err = capsys.readouterr().err
    assert "all requirements present" not in err
    line = next(ln for ln in err.splitlines() if "`datasets` package" in ln)
    assert paper.PAPER_PROMPTS in line and DATASETS_INSTALL in line


def test_check_passes_with_the_package(all_but_datasets, monkeypatch, capsys):
    monkeypatch.setattr(paper, "datasets_missing", lambda: False)
    assert main(["reproduce-paper", "--check"]) == 0
    assert "all requirements present" in capsys.readouterr().out


def test_profile_help_says_a_dataset_source_needs_the_package(capsys):
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    assert DATASETS_INSTALL in " ".join(capsys.readouterr().out.split())


def test_a_limit_above_the_set_says_it_uses_every_prompt(prompt_file, capsys):
    n = len(resolve_prompts(str(prompt_file), None)[0])
    plist, _ = resolve_prompts(str(prompt_file), 900)
    assert len(plist) == n
    err = capsys.readouterr().err
    assert f"--limit 900: {prompt_file} has {n} prompts; using all {n}" in err
    resolve_prompts(str(prompt_file), n)  # a limit the set meets: no note
    assert "--limit" not in capsys.readouterr().err
    assert limit_note("mt-bench", 900, 80) == "note: --limit 900: mt-bench has 80 prompts; using all 80"
    assert limit_note("mt-bench", None, 80) is None and limit_note("mt-bench", 80, 80) is None
