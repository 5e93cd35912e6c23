"""transformers' Llama / Qwen2 / Qwen3 decoder layers and decoder written out as functions: the same
torch operations and bits as their modules, without the module calls between them
(``decoder_layers.py``).  Imports nothing of draftcert; ``draftcert.models`` switches the models it
loads to these.
"""
