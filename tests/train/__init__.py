"""Tests of draftcert.train: the feature (EAGLE-style) drafter's training, save/load and decoding."""
