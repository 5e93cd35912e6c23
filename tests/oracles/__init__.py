"""Independent oracles: reference answers computed without importing draftcert.

``reference`` (cvxpy convex programs), ``exact_truth`` (exact / mpmath soundness truth) and
``redteam_truth`` (300-digit mpmath acceptance and brute-force radii)."""
