"""Tests of draftcert.gguf: GGUF blocks computed as stored, both numeric contracts, GGUF files."""
