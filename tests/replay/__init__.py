"""Tests of draftcert.replay: replay of profile traces equals the engine, hand-built traces, the CLI."""
