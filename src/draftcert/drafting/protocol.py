"""The drafter interface: what the decode loop calls, its optional parts declared with their defaults.

One decode drives a drafter as::

    drafter.start(prompt_ids)                    # a new sequence: reset any cache
    tree = drafter.propose(seq, widths, expand_all)   # a DraftTree hanging off seq[-1]
    drafter.observe(hidden)                      # only where needs_target_hidden: the target's features
    drafter.accept(path)                         # the tree nodes the engine kept
    drafter.forwards                             # the drafter's model passes so far

A chain of k drafts is ``widths = [1] * k``; ``expand_all=False`` grows only the drafter's greedy
child at each depth (``tree=(m, depth)``), ``expand_all=True`` expands every node (a static full tree).

The optional parts, with the defaults a drafter that does not need them inherits:

- ``needs_target_hidden`` (False): the drafter reads the target's final hidden states; the engine
  then verifies with them and hands each newly cached position's to ``observe``;
- ``depth_limit`` (None): set by the engine before every round to the tokens still allowed; a drafter
  whose drafts may run deeper than ``len(widths)`` (suffix matches) stops there;
- ``min_margin`` (None): set by the engine before every round (``--draft-margin``); a drafter with a
  distribution stops its chain where its top-2 logit gap falls below it (``tree_growth``);
- ``keep_drafting`` (None): set by the engine before every round (``-k auto``: ``adaptive``); a drafter
  with a distribution calls it after each drafted depth with its greedy tokens' probabilities so far
  and stops its chain where it returns False (``tree_growth``); a drafter without one ignores it and
  drafts ``len(widths)``;
- ``keep_grafting`` (None): set by the engine before every round (``-k auto``: ``adaptive``); a drafter
  that adds model-free nodes beyond its model's (a hybrid's suffix chain) calls it before each with
  the probability that the node is reached and accepted and the verification rows the round has
  without it, and adds no more where it returns False (``suffix.HybridDrafter``);
- ``grafts_in_plain_rounds`` (False): the drafter's model-free nodes are worth a look in a round whose
  model drafts nothing (``-k auto``'s k = 0): the engine then calls ``propose(seq, [])`` (a hybrid's suffix
  chain alone, each node priced by ``keep_grafting``; the model not run) and ``accept`` with its path;
- ``fork()`` (None): a fresh drafter with the same settings sharing the model, for batches (each row
  keeps its own state); None where the drafter cannot fork;
- ``model_drafter`` (None): the drafter that runs a model (itself for a ``ModelDrafter`` or a
  ``FeatureDrafter``, the inner one of a hybrid; None for a model-free drafter): its vocabulary is
  checked against the target's and its cache is what the cost curve rewinds.

Every drafter of this package subclasses :class:`Drafter`; ``make.as_drafter`` declares a
user's duck-typed object (``start``/``propose``/``accept``) the same way, once, at the boundary.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

from ..models.tree_attention import DraftTree

__all__ = ["Drafter", "DeclaredDrafter"]


@runtime_checkable
class Drafter(Protocol):
    """What proposes a draft tree from the accepted sequence (module docstring)."""

    forwards: int
    needs_target_hidden: bool = False
    depth_limit: int | None = None
    min_margin: float | None = None
    keep_drafting: "Callable[[Sequence[float]], bool] | None" = None
    keep_grafting: "Callable[[float, int], bool] | None" = None
    grafts_in_plain_rounds: bool = False
    model_drafter: "Drafter | None" = None  # the drafter inside that runs a model, or None

    def start(self, prompt_ids: list[int]) -> None:
        """A new sequence: reset any state."""

    def propose(self, seq: list[int], widths: list[int], expand_all: bool = False) -> DraftTree:
        """The draft tree hanging off ``seq[-1]``, at most ``widths[d]`` children per node at depth d."""
        raise NotImplementedError

    def accept(self, path: list[int]) -> None:
        """The engine kept these nodes of the last proposed tree (in order from the root)."""

    def observe(self, hidden) -> None:
        """The target's final hidden states of the positions its cache just gained, in order (only
        called where ``needs_target_hidden``)."""

    def fork(self) -> "Drafter | None":
        """A fresh drafter with the same settings, sharing the model; None where it cannot fork."""
        return None


class DeclaredDrafter(Drafter):
    """A user's drafter object (``start``/``propose``/``accept``) with the protocol's optional parts
    read from it where it has them and the defaults where it does not."""

    def __init__(self, inner):
        missing = [m for m in ("start", "propose", "accept") if not callable(getattr(inner, m, None))]
        if missing:
            raise ValueError(f"drafter: a drafter object needs start(), propose() and accept(); "
                             f"{type(inner).__name__} lacks {', '.join(m + '()' for m in missing)}")
        self.inner = inner

    @property
    def forwards(self) -> int:
        return int(getattr(self.inner, "forwards", 0))

    @property
    def needs_target_hidden(self) -> bool:
        return bool(getattr(self.inner, "needs_target_hidden", False))

    @property
    def depth_limit(self) -> int | None:
        return getattr(self.inner, "depth_limit", None)

    @depth_limit.setter
    def depth_limit(self, value: int | None) -> None:
        if hasattr(self.inner, "depth_limit"):
            self.inner.depth_limit = value

    @property
    def min_margin(self) -> float | None:
        return getattr(self.inner, "min_margin", None)

    @min_margin.setter
    def min_margin(self, value: float | None) -> None:
        if hasattr(self.inner, "min_margin"):
            self.inner.min_margin = value

    @property
    def keep_drafting(self):
        return getattr(self.inner, "keep_drafting", None)

    @keep_drafting.setter
    def keep_drafting(self, value) -> None:
        if hasattr(self.inner, "keep_drafting"):
            self.inner.keep_drafting = value

    @property
    def keep_grafting(self):
        return getattr(self.inner, "keep_grafting", None)

    @keep_grafting.setter
    def keep_grafting(self, value) -> None:
        if hasattr(self.inner, "keep_grafting"):
            self.inner.keep_grafting = value

    @property
    def model_drafter(self):
        return getattr(self.inner, "model_drafter", None)

    def start(self, prompt_ids: list[int]) -> None:
        self.inner.start(prompt_ids)

    def propose(self, seq: list[int], widths: list[int], expand_all: bool = False) -> DraftTree:
        return self.inner.propose(seq, widths, expand_all)

    def accept(self, path: list[int]) -> None:
        self.inner.accept(path)

    def observe(self, hidden) -> None:
        self.inner.observe(hidden)

    def fork(self) -> "Drafter | None":
        fork = getattr(self.inner, "fork", None)
        return DeclaredDrafter(fork()) if fork is not None else None
