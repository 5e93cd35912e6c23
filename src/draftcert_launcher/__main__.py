"""``python -m draftcert_launcher``: the ``draftcert`` command, wait policy included (``python -m
draftcert`` imports torch before anything can set it)."""

import sys

from . import main

sys.exit(main())
