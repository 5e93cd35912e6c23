"""Self-distillation data: prompts written by the target, its greedy answers, its features.

Prompts come from one of two places (``TrainConfig.prompts``, ``--prompts``):

- ``"self"`` (the default; no training data downloaded, only the evaluation sets that
  ``heldout_texts`` keeps out of it): Magpie-style, see 1. below (``write_prompts``).
- any ``draftcert.prompts.load_prompts`` source, e.g. ``"sharegpt-train"`` (ShareGPT V3 human
  turns, the training split) or a .txt/.jsonl file: ``select_prompts`` takes the first ``n``
  usable ones in a seeded shuffle, each cut to ``max_prompt_tokens`` tokens.

For each example:

1. **Prompt (Magpie-style, ``"self"`` only).**  The chat template rendered up to where a user turn's text starts
   (e.g. ``<|im_start|>system ... <|im_end|>\\n<|im_start|>user\\n``) is given to the target,
   which *samples* a user turn (temperature / top-p) until its end-of-turn token.
2. **Response.**  The target's greedy answer to that user turn (chat template applied exactly as
   ``draftcert.prompts.encode_prompt`` does at decoding time), up to ``max_new_tokens``.
3. **Features.**  One teacher-forced forward pass over prompt + response gives the target's final
   hidden state at every position (float32).  The teacher distribution at a position is
   ``softmax(lm_head(feature))`` -- the target's full next-token distribution, recomputed on the
   fly during training from the feature; full distributions are never written to disk.

Held-out prompt sets (MT-Bench, HumanEval, the ShareGPT held-out tenth ``sharegpt``) are never
trained on: ``HeldOut.overlaps`` drops any prompt that equals, contains, is contained in (at word
boundaries, when the contained side has at least ``MIN_CONTAINED_WORDS`` words), or shares an
8-word run with a held-out prompt, and the data file records how many were dropped.

Answers are written in chunks of one batch (``answer_prompts``); with ``parts`` (a directory) each
chunk is saved as it completes and a rerun loads the saved ones: an interruption loses at most one
chunk, and ``deadline`` ends a stage cleanly between chunks.

Training batches: ``radii_of`` adds the radius of every position (the certificate objective's
target), ``token_batches`` groups examples by length, ``collate`` stacks one group into tensors.
"""

from __future__ import annotations

import ctypes
import json
import random
import re
import sys
import time
from pathlib import Path

import torch

from ..certificates import radius
from ..fileio import atomic_path, write_json
from ..models.hf import cache_kwarg, eos_token_ids, left_pad, new_cache, pad_token_id
from ..prompts import encode_prompt, load_prompts

SENTINEL = "\x00DRAFTCERT_USER\x00"


def user_prefix_ids(tok) -> list[int]:
    """Token ids of the chat template up to the start of a user turn's text."""
    if getattr(tok, "chat_template", None) is None:
        raise ValueError("train-drafter: the target's tokenizer has no chat template (needed for Magpie-style prompts)")
    text = tok.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False, add_generation_prompt=False)
    if SENTINEL not in text:
        raise ValueError("train-drafter: cannot locate the user turn in the chat template")
    prefix = text[: text.index(SENTINEL)]
    return tok(prefix, add_special_tokens=False)["input_ids"]


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


MIN_CONTAINED_WORDS = 3  # "hi" held out must not drop every prompt containing "hi" (or "this")


class HeldOut:
    """Index of held-out prompts for overlap checks (normalised text and word n-grams).

    ``overlaps(t)``: t equals a held-out prompt h; or one contains the other at word boundaries,
    the contained side having at least ``MIN_CONTAINED_WORDS`` words; or t and some h share a run
    of ``n`` words.  Containment of a side with >= n words is a shared n-word run, so only shorter
    sides are checked for containment: the check stays cheap with thousands of held-out prompts.
    """

    def __init__(self, texts, n: int = 8):
        self.n = n
        self.norms = set()
        self.grams = set()
        self.short = {}  # word count (MIN_CONTAINED_WORDS..n-1) -> held-out prompts of that many words
        long_norms = []
        for t in texts:
            w = _words(t)
            if not w:
                continue
            self.norms.add(" ".join(w))
            self.grams.update(tuple(w[i : i + n]) for i in range(len(w) - n + 1))
            if MIN_CONTAINED_WORDS <= len(w) < n:
                self.short.setdefault(len(w), set()).add(tuple(w))
            long_norms.append(f" {' '.join(w)} ")
        self.padded = long_norms  # " h " for the word-boundary containment of short prompts

    def overlaps(self, text: str) -> bool:
        w = _words(text)
        if not w:
            return False
        t = " ".join(w)
        if t in self.norms:
            return True
        # a short held-out prompt inside t
        if any(tuple(w[i : i + L]) in hs for L, hs in self.short.items() for i in range(len(w) - L + 1)):
            return True
        if len(w) >= self.n:
            return any(tuple(w[i : i + self.n]) in self.grams for i in range(len(w) - self.n + 1))
        # a short t inside a held-out prompt
        return len(w) >= MIN_CONTAINED_WORDS and any(f" {t} " in h for h in self.padded)


HELDOUT_SOURCES = ("mt-bench", "humaneval", "sharegpt")


def heldout_texts() -> list[str]:
    """Every prompt of the evaluation sets (MT-Bench, HumanEval, ShareGPT's held-out tenth): never trained on."""
    return [p.text for src in HELDOUT_SOURCES for p in load_prompts(src)]


@torch.inference_mode()
def _batched_generate(model, seqs, max_new, eos: set[int], pad: int, *, sample: bool, temperature=1.0, top_p=0.95,
                      gen=None, features: bool = False, on_step=None):
    """Batched left-padded generation with a KV cache (greedy or sampled).

    Returns the new tokens per row, and with ``features=True`` also each row's final hidden
    states (float32, one per position of prompt + new tokens except the last token, whose
    successor is never predicted) -- collected from the very passes that generated the tokens.
    ``on_step(n)`` hears of each step: n = the rows that produced a token (a progress bar).
    """
    dev = model.device
    ids, mask, pos = left_pad(seqs, pad, dev)
    cache = new_cache(model)
    out = [[] for _ in seqs]
    feats = [[] for _ in seqs]
    done = [False] * len(seqs)
    T0 = ids.shape[1]
    cur_ids, cur_pos = ids, pos
    head, dec = model.get_output_embeddings(), (model.get_decoder() if features else None)
    for step in range(max_new):
        if features:
            f = dec(input_ids=cur_ids, attention_mask=mask, position_ids=cur_pos, use_cache=True,
                    **{cache_kwarg(dec): cache}).last_hidden_state
            logits = head(f[:, -1:]).squeeze(1).float()
            for i in range(len(seqs)):
                if not done[i]:
                    feats[i].append(f[i, T0 - len(seqs[i]) :].float().cpu() if step == 0 else f[i].float().cpu())
        else:
            logits = model(input_ids=cur_ids, attention_mask=mask, position_ids=cur_pos, use_cache=True,
                           logits_to_keep=1, **{cache_kwarg(model): cache}).logits[:, -1].float()
        if sample:
            # top-p within the top 64 (a full sort of the vocabulary per step costs as much as the forward)
            top, idx = torch.topk(logits / temperature, 64, dim=-1)
            sp = torch.softmax(top, -1)
            keep = sp.cumsum(-1) - sp < top_p
            sp = sp * keep
            choice = torch.multinomial(sp / sp.sum(-1, keepdim=True), 1, generator=gen)
            nxt = idx.gather(1, choice).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        if on_step is not None:
            on_step(done.count(False))
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
                if t in eos:
                    done[i] = True
        if all(done):
            break
        cur_ids = nxt[:, None]
        cur_pos = cur_pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=mask.dtype, device=dev)], 1)
    if features:
        return out, [torch.cat(f, 0) for f in feats]
    return out


def write_prompts(target, tok, n: int, *, max_prompt_tokens: int = 48, batch: int = 32, seed: int = 0,
                  heldout: HeldOut | None = None, temperature: float = 1.0, top_p: float = 0.95, log=print,
                  progress: bool = False) -> tuple[list[str], dict]:
    """``n`` distinct user turns written by the target (Magpie-style), and what was dropped.

    Prompts are sampled in batches until ``n`` distinct, non-empty, non-held-out ones exist.
    ``progress``: a bar on stderr counting generated tokens ("writing prompts").
    """
    from tqdm.auto import tqdm  # optional: models extra

    if n < 1:
        raise ValueError(f"train-drafter: need at least 1 example, got {n}")
    gen = torch.Generator().manual_seed(seed)
    prefix = user_prefix_ids(tok)
    eos = eos_token_ids(target, tok)
    pad = pad_token_id(tok, target)
    prompts, seen, dropped = [], set(), {"heldout": 0, "empty": 0, "duplicate": 0, "truncated (kept)": 0}
    t0 = time.perf_counter()
    tries = 0
    per_try = batch * max_prompt_tokens  # tokens of one batch of prompts, at most
    bar = tqdm(total=-(-n // batch) * per_try, unit="tok", desc="writing prompts", disable=not progress,
               dynamic_ncols=True, file=sys.stderr)
    while len(prompts) < n:
        tries += 1
        if tries > 50:
            bar.close()
            raise RuntimeError(f"train-drafter: could not sample {n} usable prompts (got {len(prompts)}; dropped {dropped})")
        bar.total = max(bar.total, tries * per_try)  # dropped prompts cost another batch
        outs = _batched_generate(target, [prefix] * batch, max_prompt_tokens, eos, pad, sample=True,
                                 temperature=temperature, top_p=top_p, gen=gen, on_step=bar.update)
        bar.update(tries * per_try - bar.n)
        for o in outs:
            text = tok.decode([t for t in o if t not in eos], skip_special_tokens=True).strip()
            if not o or o[-1] not in eos:
                dropped["truncated (kept)"] += 1  # a user turn cut at max_prompt_tokens is still a prompt
            if len(text) < 8:
                dropped["empty"] += 1
                continue
            if text in seen:
                dropped["duplicate"] += 1
                continue
            if heldout is not None and heldout.overlaps(text):
                dropped["heldout"] += 1
                continue
            seen.add(text)
            prompts.append(text)
        bar.set_postfix_str(f"prompts {min(len(prompts), n)}/{n}")
        log(f"prompts: {min(len(prompts), n)}/{n} ({time.perf_counter() - t0:.0f} s)")
    bar.total = bar.n
    bar.close()
    return prompts[:n], dropped


def select_prompts(prompts, n: int, tok, *, max_prompt_tokens: int, seed: int = 0, heldout: HeldOut | None = None,
                   source: str = "prompts") -> tuple[list[str], dict]:
    """The first ``n`` usable prompt texts of ``prompts`` (``Prompt``s or strings) in a seeded shuffle.

    Usable: at least 8 characters, not a duplicate, no overlap with ``heldout`` (checked on the
    whole text).  A prompt longer than ``max_prompt_tokens`` tokens is cut to that many (the text
    of its first tokens); shorter ones keep their exact text.  The shuffle (``random.Random(seed)``)
    depends only on the order of ``prompts`` and the seed, so a rerun selects the same prompts.
    """
    if n < 1:
        raise ValueError(f"train-drafter: need at least 1 example, got {n}")
    texts = [getattr(p, "text", p) for p in prompts]
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    out, seen = [], set()
    dropped = {"heldout": 0, "empty": 0, "duplicate": 0, "truncated (kept)": 0}
    for i in order:
        text = texts[i].strip()
        if len(text) < 8:
            dropped["empty"] += 1
            continue
        ids = tok(text, add_special_tokens=False)["input_ids"]
        short = text
        if len(ids) > max_prompt_tokens:
            short = tok.decode(ids[:max_prompt_tokens], skip_special_tokens=True).strip()
        if short in seen:
            dropped["duplicate"] += 1
            continue
        if heldout is not None and heldout.overlaps(text):
            dropped["heldout"] += 1
            continue
        dropped["truncated (kept)"] += short != text
        seen.add(short)
        out.append(short)
        if len(out) == n:
            return out, dropped
    raise ValueError(f"--prompts {source}: only {len(out)} usable prompts of {len(texts)} (dropped {dropped}); "
                     f"ask for fewer --examples (train + held-out) or use a larger source")


def template_prefix_tokens(tok) -> int:
    """Leading tokens every chat-template prompt shares (system prompt, user header): not trained on."""
    if getattr(tok, "chat_template", None) is None:
        return 0
    return max(len(user_prefix_ids(tok)) - 1, 0)


def answer_prompts(target, tok, prompts: list[str], *, max_new_tokens: int = 128, batch: int = 32, n_skip: int = 0,
                   log=print, progress: bool = False, parts: Path | None = None, deadline: float | None = None):
    """Examples for ``prompts``: the target's greedy answers and its features, in chunks of ``batch``.

    Each example: ``{"prompt", "ids" (prompt + answer), "n_prompt", "n_skip", "features" [T, H]}``.
    Prompts are answered longest first (similar lengths share a left-padded batch).  ``parts``: a
    directory where each chunk is saved as it completes (``answers-NNNNN.pt``) next to
    ``prompts.json`` (the prompt list, which a rerun must match); saved chunks are loaded, not
    regenerated.  ``deadline`` (``time.monotonic()``): stop before a chunk that would start after
    it and return None (rerun to continue).  ``progress``: a bar on stderr ("writing answers").
    """
    from tqdm.auto import tqdm  # optional: models extra

    n = len(prompts)
    if parts is not None:
        parts = Path(parts)
        parts.mkdir(parents=True, exist_ok=True)
        listing = parts / "prompts.json"
        rec = {"prompts": list(prompts), "max_new_tokens": max_new_tokens, "batch": batch}
        if listing.is_file():
            if json.loads(listing.read_text()) != rec:
                raise ValueError(f"{parts} holds answers to other prompts or settings; delete that directory "
                                 "or use a new --out")
        else:
            write_json(listing, rec)
    eos = eos_token_ids(target, tok)
    pad = pad_token_id(tok, target)
    t0 = time.perf_counter()
    enc = [list(encode_prompt(tok, p)) for p in prompts]
    order = sorted(range(n), key=lambda i: -len(enc[i]))
    examples = []
    bar = tqdm(total=n * max_new_tokens, unit="tok", desc="writing answers", disable=not progress, dynamic_ncols=True,
               file=sys.stderr)
    for c, j in enumerate(range(0, n, batch)):
        idx = order[j : j + batch]
        saved = parts / f"answers-{c:05d}.pt" if parts is not None else None
        if saved is not None and saved.is_file():
            examples += torch.load(saved, weights_only=False)
            bar.update((j + len(idx)) * max_new_tokens - bar.n)
            continue
        if deadline is not None and time.monotonic() >= deadline:
            bar.close()
            log(f"responses: stage ends at {len(examples)}/{n} (saved in {parts}); rerun to continue")
            return None
        resp, feats = _batched_generate(target, [enc[i] for i in idx], max_new_tokens, eos, pad, sample=False,
                                        features=True, on_step=bar.update)
        bar.update((j + len(idx)) * max_new_tokens - bar.n)  # the tokens its EOS-ended answers did not take
        bar.set_postfix_str(f"answers {j + len(idx)}/{n}")
        chunk = []
        for i, r, f in zip(idx, resp, feats):
            # The generating passes saw every token but the last one: keep the positions with a feature.
            ids = (enc[i] + r)[: f.shape[0]]
            chunk.append({"prompt": prompts[i], "ids": ids, "n_prompt": len(enc[i]), "n_skip": n_skip, "features": f})
        if saved is not None:
            with atomic_path(saved) as tmp:  # an interruption loses at most the chunk being written
                torch.save(chunk, tmp)
        examples += chunk
        log(f"responses: {len(examples)}/{n} ({time.perf_counter() - t0:.0f} s)")
    bar.close()
    log(f"features: {n} sequences, {sum(len(e['ids']) for e in examples)} tokens ({time.perf_counter() - t0:.0f} s)")
    return examples


def generate_examples(target, tok, n: int, *, max_prompt_tokens: int = 48, max_new_tokens: int = 128,
                      batch: int = 32, seed: int = 0, heldout: HeldOut | None = None, temperature: float = 1.0,
                      top_p: float = 0.95, log=print, progress: bool = False):
    """``n`` self-generated examples (``write_prompts`` then ``answer_prompts``), and what was dropped.

    ``progress``: a bar per stage on stderr ("writing prompts", "writing answers"), counting
    generated tokens: a batch takes minutes, so a bar of prompts would sit still and then jump.
    """
    t0 = time.perf_counter()
    prompts, dropped = write_prompts(target, tok, n, max_prompt_tokens=max_prompt_tokens, batch=batch, seed=seed,
                                     heldout=heldout, temperature=temperature, top_p=top_p, log=log, progress=progress)
    examples = answer_prompts(target, tok, prompts, max_new_tokens=max_new_tokens, batch=batch,
                              n_skip=template_prefix_tokens(tok), log=log, progress=progress)
    return examples, {"dropped": dropped, "seconds": time.perf_counter() - t0}


def vocabulary_score(examples, vocab_size: int, score: torch.Tensor | None = None) -> torch.Tensor:
    """``draft_vocabulary``'s frequency of every token over ``examples``, added into ``score`` ([V] float64,
    a new zero one when None) example by example in order: observed count, then expected count
    (``e["mass"]``, when present).  A running score over consecutive slices of the examples is the
    same float64 sum as one call over all of them."""
    if score is None:
        score = torch.zeros(vocab_size, dtype=torch.float64)
    for e in examples:
        score += torch.bincount(torch.tensor(e["ids"]), minlength=vocab_size).double()
        if "mass" in e:
            score += e["mass"].double()
    return score


def draft_vocabulary(examples, size: int, vocab_size: int, always=(), score: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` most frequent token ids of the examples, plus ``always`` (e.g. EOS).

    Frequency = observed count + the target's expected count (the sum of its next-token
    probabilities over every position, ``e["mass"]`` when present): with a few ten thousand
    tokens of data, the expected count also ranks the many tokens the greedy text happens not
    to contain but the target often predicts.  Ties go to the lower id.  ``score``: that frequency
    already summed (``vocabulary_score``; ``examples`` then unused).
    """
    score = vocabulary_score(examples, vocab_size) if score is None else score.clone()
    size = min(int(size), vocab_size)
    for t in always:
        score[t] = float("inf")  # EOS etc. must be draftable
    order = sorted(range(vocab_size), key=lambda i: (-float(score[i]), i))
    return torch.tensor(order[:size]).sort().values


# ----------------------------------------------------------------------------- training batches


# radii_of hands glibc's freed heap pages back every this many examples: each example's [T, V] temporaries
# (tens of MB, under glibc's mmap threshold once it has risen) left ~3 MB of a fragmented heap resident, and a
# 24,000-example run grew past 24 GB (``benchmarks/bench_radii_memory.py``: 3.8 MB an example without, bounded with)
RELEASE_EVERY = 32


def _release_free_memory() -> None:
    """``malloc_trim(0)``: glibc returns the free pages inside its heaps to the system; a no-op without glibc."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None  # libc's malloc_trim, looked up on first use (False: none)


def radii_of(target, examples, criterion, log, progress: bool = False) -> None:
    """In place: each example's radius r_t = radius(criterion, p_t) at every position ([T], float32) and
    ``mass``, the target's expected token counts over its positions ([V]); skips examples that have them.
    ``progress``: a bar on stderr counting the examples."""
    from tqdm.auto import tqdm  # optional: models extra

    W = target.get_output_embeddings().weight
    t0 = time.perf_counter()
    for i, e in enumerate(tqdm(examples, unit="example", desc="radii", disable=not progress, dynamic_ncols=True,
                               file=sys.stderr)):
        if i % RELEASE_EVERY == RELEASE_EVERY - 1:
            _release_free_memory()
        if "radius" in e and "teacher_lse" in e:
            continue
        f = e["features"].to(W.dtype)
        with torch.no_grad():
            z = f @ W.T  # [T, V]: the target's logits, recomputed from its features
            z = z.float()
            e["radius"] = torch.as_tensor(radius(criterion, logits=z)).float()
            # the teacher's normaliser and negentropy per position: training then needs only the draft
            # vocabulary's logits (objective.batch_loss), not the [T, V] ones.  sum p log p = sum p z - lse.
            p = torch.softmax(z, -1)  # [T, V]
            e["teacher_lse"] = torch.logsumexp(z, -1)
            e["teacher_negent"] = torch.linalg.vecdot(p, z) - e["teacher_lse"]
            # the target's expected token counts here: ranks the draft vocabulary (smoother than counts)
            e["mass"] = p.sum(0)
    log(f"radii ({criterion}) for {len(examples)} sequences in {time.perf_counter() - t0:.1f} s")


def token_batches(examples, batch_tokens, rng) -> list[list[int]]:
    """Example indices grouped into batches of similar length (padded size <= ``batch_tokens``), shuffled by ``rng``."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
    groups, cur, cur_max = [], [], 0
    for i in order:
        L = len(examples[i]["ids"])
        if cur and max(cur_max, L) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, L)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def collate(examples, idx, dtype, device):
    """(ids [B, T], features [B, T, H], lengths [B], radii [B, T], skip [B], teacher_lse [B, T] or None,
    teacher_negent [B, T] or None) of examples ``idx``, right-padded with zeros (the teacher's terms
    where every example has them: ``radii_of``)."""
    L = [len(examples[i]["ids"]) for i in idx]
    T = max(L)
    H = examples[idx[0]]["features"].shape[1]
    ids = torch.zeros(len(idx), T, dtype=torch.long)
    feats = torch.zeros(len(idx), T, H, dtype=dtype)
    radii = torch.zeros(len(idx), T)
    terms = all("teacher_lse" in examples[i] for i in idx)
    lse = torch.zeros(len(idx), T) if terms else None
    negent = torch.zeros(len(idx), T) if terms else None
    skip = torch.tensor([examples[i].get("n_skip", 0) for i in idx], device=device)
    for b, i in enumerate(idx):
        e = examples[i]
        n = L[b]
        ids[b, :n] = torch.tensor(e["ids"])
        feats[b, :n] = e["features"].to(dtype)
        radii[b, :n] = e["radius"]
        if terms:
            lse[b, :n], negent[b, :n] = e["teacher_lse"], e["teacher_negent"]
    moved = [None if t is None else t.to(device) for t in (lse, negent)]
    return ids.to(device), feats.to(device), torch.tensor(L, device=device), radii.to(device), skip, *moved
