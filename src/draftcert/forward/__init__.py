"""transformers' Llama / Qwen2 / Qwen3 decoder layers and decoder written out as functions: the same
torch operations and bits as their modules, without the module calls between them
(``decoder_layers.py``); a layer whose projections all run ``gguf-q8`` computed natively instead, in
two calls (``native_layer.py``, its own bits).  Imports only ``gguf`` and ``kernels`` below it;
``draftcert.models`` switches the models it loads to these.
"""
