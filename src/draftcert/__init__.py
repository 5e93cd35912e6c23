"""draftcert: exact acceptance certificates for speculative decoding.

Every deterministic verification rule rejects a drafted token exactly when it
lies in a lower level set of the target distribution p.  ``radius`` gives the
smallest divergence D(p, q) that can cause a rejection; ``D(p, q) < radius(p)``
certifies acceptance.
"""

import importlib

from .bounds import margin_bound, margin_bound_from_statistic, margin_statistic
from .certificates import accepts, certified, certified_run_length, radii, radius
from .criteria import (
    Additive,
    Criterion,
    EntropyThreshold,
    LevelSet,
    MarginAware,
    Multiplicative,
    Strict,
    TopM,
    TreeCoverage,
    TypicalAcceptance,
    parse_criterion,
)
from .divergences import DIVERGENCES, divergence
from .summary import Summary, summarize

__version__ = "0.1.0"


def __getattr__(name):
    # ``draftcert.generate`` (transformers' custom_generate callable) lives in draftcert.generation, a
    # high layer that imports transformers and the decoding engine: importing it here would pull both
    # into every ``import draftcert`` and make this core package import upward (every module that
    # imports ``draftcert`` would then depend on the top layer).  So it is looked up on first use,
    # by name, which is no static import edge.
    if name == "generate":
        return importlib.import_module(".generation", __name__).generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "parse_criterion",
    "Criterion",
    "Strict",
    "Additive",
    "Multiplicative",
    "TopM",
    "EntropyThreshold",
    "TypicalAcceptance",
    "MarginAware",
    "TreeCoverage",
    "LevelSet",
    "radius",
    "radii",
    "margin_bound",
    "margin_statistic",
    "margin_bound_from_statistic",
    "divergence",
    "accepts",
    "certified",
    "certified_run_length",
    "summarize",
    "Summary",
    "DIVERGENCES",
]
