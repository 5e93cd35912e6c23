"""Tests of draftcert.decode: the speculative decoding engine, trees, and the decode / bench CLI."""
