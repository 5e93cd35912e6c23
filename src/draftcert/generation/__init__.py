"""draftcert inside transformers' ``generate``: a ``custom_generate`` callable and its hub folder.

    import draftcert
    out = model.generate(**inputs, custom_generate=draftcert.generate, criterion="topm:2", max_new_tokens=64)

    from draftcert.generation import write_folder
    write_folder("my-draftcert-generate")      # <path>/custom_generate/{generate.py, requirements.txt}
    model.generate(**inputs, custom_generate="my-draftcert-generate", trust_remote_code=True)

``custom``: the callable (``generate``) and its output type; ``folder``: the shareable folder form.
See docs/generate.md.
"""

from .custom import MIN_TRANSFORMERS, DraftcertGenerateOutput, check_transformers, default_drafter, generate
from .folder import HUB_FOLDER, folder_generate, write_folder

__all__ = [
    "generate",
    "DraftcertGenerateOutput",
    "MIN_TRANSFORMERS",
    "check_transformers",
    "default_drafter",
    "write_folder",
    "folder_generate",
    "HUB_FOLDER",
]
