"""Tests of draftcert.evaluate: the executor, programs and answers, the evaluate run and its report."""
