"""Drafters: what proposes a draft tree from the accepted sequence, and the one loop that grows it.

- ``protocol.py``: ``Drafter``, the interface the decode loop calls, its optional parts declared;
- ``make.py``: ``make_drafter`` (a ``--drafter`` spec, a causal LM or a drafter object -> a drafter)
  and the defaults;
- ``model_drafter.py``: ``ModelDrafter``, a causal LM drafting from its own KV cache;
- ``draft_vocab.py``: ``DraftVocabulary`` (a prefix or a token map of the tokens a causal-LM drafter may
  propose) and ``VocabHead``, its output layer over them;
- ``prompt_lookup.py``: ``PromptLookupDrafter``, n-gram matches in the sequence;
- ``feature_drafter.py``: ``FeatureDrafter``, the EAGLE-style head on the target's hidden states
  (its network is ``models/eagle.py``);
- ``suffix.py``: suffix-match candidates (``SuffixDrafter``) and a model drafter with them (``HybridDrafter``);
- ``tree_growth.py``: ``grow_tree``, the one tree-growing loop and tie rule of the drafters with a distribution.

The decode loop (``draftcert.decode``) calls a drafter through ``protocol.Drafter``;
drafters only import ``models`` (the draft tree type and the cache roll-back live there).
"""

from .draft_vocab import DraftVocabulary
from .make import as_drafter, make_drafter
from .model_drafter import ModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .protocol import Drafter
from .suffix import HybridDrafter, SuffixDrafter, SuffixIndex, SuffixStore

__all__ = ["Drafter", "DraftVocabulary", "make_drafter", "as_drafter", "ModelDrafter", "PromptLookupDrafter", "SuffixDrafter", "HybridDrafter", "SuffixIndex",
           "SuffixStore"]
