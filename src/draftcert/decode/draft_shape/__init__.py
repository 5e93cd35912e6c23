"""The draft's shape before each round: what a round costs on this machine and how long to draft.

``costs.py`` times the engine's rounds on this machine (the cost curve, cached) and prices a round
with the model the replay shares; ``adaptive.py`` picks each round's chain length (none included)
for ``-k auto`` from those costs and the acceptance a decode sees; ``shape.py`` starts it (the prior
acceptance, the cost curve, the line ``decode`` prints) and chooses a tree rule's tree once.
"""
