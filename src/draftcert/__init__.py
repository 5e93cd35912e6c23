"""draftcert: exact acceptance certificates for speculative decoding.

Every deterministic verification rule rejects a drafted token exactly when it
lies in a lower level set of the target distribution p.  ``radius`` gives the
smallest divergence D(p, q) that can cause a rejection; ``D(p, q) < radius(p)``
certifies acceptance.

Importing draftcert before torch bounds the OpenMP threads' idle spin (``GOMP_SPINCOUNT=3000``,
as the ``draftcert`` command does, ``draftcert_launcher``), unless the environment sets
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``: next to a busy process, torch's default spin makes
one-token decoding several times slower (docs/speed.md).  After ``import torch`` it is too late
(libgomp reads the variable when torch loads) and nothing is set.
"""

import importlib
import sys

from draftcert_launcher import set_wait_policy  # torch-free (outside this package), so it can run first

if "torch" not in sys.modules:  # libgomp reads the policy once, when torch is first imported (just below)
    set_wait_policy()

from .bounds import margin_bound, margin_bound_from_statistic, margin_statistic
from .certificates import accepts, certified, certified_run_length, radii, radius
from .criteria import (Additive, Criterion, EntropyThreshold, LevelSet, MarginAware, Multiplicative, RelaxedAcceptance,
                       Strict, TopM, TreeCoverage, TypicalAcceptance, parse_criterion)
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
    "parse_criterion", "Criterion", "Strict", "Additive", "Multiplicative", "TopM", "RelaxedAcceptance", "EntropyThreshold",
    "TypicalAcceptance", "MarginAware", "TreeCoverage", "LevelSet",
    "radius", "radii", "margin_bound", "margin_statistic", "margin_bound_from_statistic", "divergence", "accepts",
    "certified", "certified_run_length", "summarize", "Summary", "DIVERGENCES",
]
