"""GGUF files computed as stored: the file reader, the table of block types, the layers that keep
blocks, the numeric contracts and the loader of a transformers causal LM from a GGUF file.

The kernels these layers call are ``draftcert.kernels.block_matmul``; the models that use them are
loaded by ``draftcert.models`` (``load_target``, the pair).  docs/gguf.md states the contracts.
"""
