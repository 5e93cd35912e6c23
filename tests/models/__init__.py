"""Tests of draftcert.models: the embedded target, tiny models, checkpoint loading, derived drafters."""
