"""`decode --json`'s draft shape (issue 31): `k` is the true depth, the widths sit under
`tree_widths`, and `tree_shape` is the "3x2" the `-k auto` line prints."""

from __future__ import annotations

import json

import pytest

from draftcert.cli import main
from draftcert.cli.decode import tree_shape
from draftcert.decode.stats import DecodeStats


def _summary(ckpt, capsys, *extra):
    assert main(["decode", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hello",
                 "--max-new-tokens", "6", "--json", "--no-warmup", *extra]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]


def test_a_tree_reports_its_depth_widths_and_shape(ckpt, capsys):
    s = _summary(ckpt, capsys, "--tree", "3,2")
    assert s["k"] == 2 and s["tree_widths"] == [3, 3] and s["tree_shape"] == "3x2"
    assert "tree" not in s  # no key whose list could be read as "3 wide, 3 deep"


def test_a_chain_has_no_tree(ckpt, capsys):
    s = _summary(ckpt, capsys, "-k", "3")
    assert s["k"] == 3 and s["tree_widths"] is None and s["tree_shape"] is None


def test_a_tree_rule_reports_its_own_tree(ckpt, capsys):
    s = _summary(ckpt, capsys, "-k", "2", "--criterion", "tree:3")
    assert s["k"] == 2 and s["tree_widths"] == [3, 3] and s["tree_shape"] == "3x2"


def test_shape_names():
    assert DecodeStats("strict", 1, [2, 2, 2]).summary()["k"] == 3  # the depth, not the -k a tree ignores
    assert tree_shape("3,2", [3, 3]) == tree_shape((3, 2), [3, 3]) == "3x2"
    assert tree_shape([4, 2, 1], [4, 2, 1]) == "4,2,1" and tree_shape([3, 3], [3, 3]) == "3,3"  # static trees
    assert tree_shape(None, None) is None
