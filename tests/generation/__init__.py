"""Tests of draftcert inside transformers' generate (custom_generate)."""
