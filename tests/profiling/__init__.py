"""Tests of draftcert.profile: the KV-cache loop, trace shards, the profile CLI, data-parallel runs."""
