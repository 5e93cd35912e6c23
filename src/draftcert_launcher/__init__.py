"""The ``draftcert`` console command: bound the OpenMP threads' spinning, then run the CLI.

torch runs its CPU kernels on OpenMP threads (GNU libgomp).  Between two parallel regions an
idle libgomp thread *spins* for GOMP_SPINCOUNT iterations (default 300,000) before it sleeps.
Decoding one token at a time is thousands of tiny parallel regions, so next to a busy process
the spinning threads take the CPU the working thread needs: decodes measured next to a busy
process ran ten times slower, burning 94 s of CPU for 16 s of work (issue 23).  A short spin
keeps most of the speed of spinning on a quiet machine and lets a busy neighbour slow decoding
only in proportion to the CPU it takes; ``OMP_WAIT_POLICY=PASSIVE`` (no spin at all) is immune
to the neighbour but much slower alone.  ``python benchmarks/bench_spin.py`` on 2 cores (embedded
target, greedy, 2 threads), tokens/s alone -> next to a ``while True: pass`` process:

    GOMP_SPINCOUNT  300,000 (default)  30.3 -> 2.3     (spinning threads starve the working one)
                     10,000            29.5 -> 8.8
                      3,000            24.9 -> 13.4    (chosen: a neighbour costs ~half, in proportion)

libgomp reads these variables once, when it is loaded, i.e. when torch is first imported, and
``import draftcert`` imports torch.  So this module lives outside the ``draftcert`` package
(importing anything inside it would import torch first) and imports nothing: the command calls
``set_wait_policy`` before it imports the CLI, and ``import draftcert`` calls it first thing when
torch is not loaded yet (a Python program that decodes gets the same bound as the command; after
``import torch`` it would be too late, and nothing is set).  Never when the user chose a policy:
with ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment nothing is set
(``OMP_WAIT_POLICY=ACTIVE draftcert ...`` spins as asked, ``GOMP_SPINCOUNT=300000`` restores
torch's default).  The variable is set in ``os.environ``, so child processes inherit it.
"""

from __future__ import annotations

import os

SPIN_COUNT = "3000"  # iterations an idle OpenMP thread spins before it sleeps (see the table above)
USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # either one set by the user: leave both alone


def set_wait_policy(environ=None) -> dict[str, str]:
    """Set ``GOMP_SPINCOUNT`` unless the environment already chooses a wait policy; returns what was set."""
    env = os.environ if environ is None else environ
    if any(k in env for k in USER_KNOBS):
        return {}
    env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


def main() -> int:
    set_wait_policy()
    from draftcert.cli import main as cli_main  # after the environment: it imports torch (and libgomp)

    return cli_main()
