"""Tests of draftcert.kernels: the native kernels and the fast paths of a CPU forward pass."""
