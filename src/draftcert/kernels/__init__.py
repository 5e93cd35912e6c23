"""Native kernels and the torch-level fast paths of a CPU forward pass.

C sources and their bindings, each compiled on first use through ``draftcert.native`` (one build
path; symbols prefixed per library):

- ``block_matmul.c/.py``: ``x @ W.T`` with W kept as GGUF blocks, under both numeric contracts
  (``dq_`` float32 sums on the exact dequantised weights; ``dq8_`` 8-bit activations as llama.cpp);
- ``packed_matmul.c/.py``: float32 weights packed in column blocks, read once for 1..16 rows (``pm_``);
- ``row_attention.c/.py``: attention one query row at a time, batch invariant (``ra_``).

Fast paths that replace transformers' module calls with the same operations:

- ``linear_chooser.py``: per weight shape and row count, the linear kernel timed fastest on this CPU;
- ``attention.py``: grouped-query SDPA without the KV copy, and the row-invariant attention switch.

The Llama / Qwen2 / Qwen3 decoder layers written out as functions are ``draftcert.forward``.

Nothing here imports a higher layer of draftcert: models and GGUF files (``draftcert.gguf``) use these.
"""
