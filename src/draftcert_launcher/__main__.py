"""``python -m draftcert_launcher``: the ``draftcert`` command, wait policy included (``python -m
draftcert`` gets it too, from ``import draftcert``)."""

import sys

from . import main

sys.exit(main())
