"""Tests of draftcert.drafting: the drafters and the tree-growing loop."""
