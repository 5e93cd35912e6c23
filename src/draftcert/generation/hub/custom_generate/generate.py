"""draftcert: greedy speculative decoding with exact acceptance certificates, as a transformers
``custom_generate`` folder.

    model.generate(**inputs, custom_generate="PATH_OR_HUB_REPO", trust_remote_code=True,
                   drafter="prompt-lookup", criterion="topm:2", max_new_tokens=64)

Needs ``pip install draftcert`` and transformers >= 4.57.  Every argument is passed through to
``draftcert.generate`` (see draftcert's docs/generate.md).
"""

import draftcert.generation


def generate(model, **kwargs):
    return draftcert.generation.folder_generate(model, **kwargs)
