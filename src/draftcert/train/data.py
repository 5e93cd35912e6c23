"""Self-distillation data: prompts written by the target, its greedy answers, its features.

Nothing is downloaded.  For each example:

1. **Prompt (Magpie-style).**  The chat template rendered up to where a user turn's text starts
   (e.g. ``<|im_start|>system ... <|im_end|>\\n<|im_start|>user\\n``) is given to the target,
   which *samples* a user turn (temperature / top-p) until its end-of-turn token.
2. **Response.**  The target's greedy answer to that user turn (chat template applied exactly as
   ``draftcert.prompts.encode_prompt`` does at decoding time), up to ``max_new_tokens``.
3. **Features.**  One teacher-forced forward pass over prompt + response gives the target's final
   hidden state at every position (float32).  The teacher distribution at a position is
   ``softmax(lm_head(feature))`` -- the target's full next-token distribution, recomputed on the
   fly during training from the feature; full distributions are never written to disk.

Held-out prompt sets (MT-Bench, HumanEval) are never used: ``HeldOut.overlaps`` drops any
generated prompt that equals, contains, is contained in, or shares an 8-word run with a held-out
prompt, and the data file records how many were dropped.

Training batches: ``radii_of`` adds the radius of every position (the certificate objective's
target), ``token_batches`` groups examples by length, ``collate`` stacks one group into tensors.
"""

from __future__ import annotations

import re
import sys
import time

import torch

from ..certificates import radius
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


def _norm(text: str) -> str:
    return " ".join(_words(text))


class HeldOut:
    """Index of held-out prompts for overlap checks (normalised text and word 8-grams)."""

    def __init__(self, texts, n: int = 8):
        self.n = n
        self.norms = [_norm(t) for t in texts]
        self.grams = set()
        for t in texts:
            w = _words(t)
            self.grams.update(tuple(w[i : i + n]) for i in range(len(w) - n + 1))

    def overlaps(self, text: str) -> bool:
        t = _norm(text)
        if not t:
            return False
        for h in self.norms:
            if h and (t == h or t in h or h in t):
                return True
        w = t.split()
        return any(tuple(w[i : i + self.n]) in self.grams for i in range(len(w) - self.n + 1))


def heldout_texts() -> list[str]:
    """Every MT-Bench and HumanEval prompt (what evaluation uses; never trained on)."""
    return [p.text for src in ("mt-bench", "humaneval") for p in load_prompts(src)]


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


def generate_examples(target, tok, n: int, *, max_prompt_tokens: int = 48, max_new_tokens: int = 128,
                      batch: int = 32, seed: int = 0, heldout: HeldOut | None = None, temperature: float = 1.0,
                      top_p: float = 0.95, log=print, progress: bool = False):
    """``n`` self-generated examples: dicts with prompt text, token ids, response length, features.

    Prompts are drawn in batches until ``n`` distinct, non-empty, non-held-out ones exist.
    ``progress``: a bar per stage on stderr ("writing prompts", "writing answers"), counting
    generated tokens: a batch takes minutes, so a bar of prompts would sit still and then jump.
    A row that ends early (EOS) is topped up to its full share when its batch ends.
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
    prompts = prompts[:n]
    enc = [list(encode_prompt(tok, p)) for p in prompts]
    examples = []
    # Every sequence starts with the same template prefix (system prompt, user header): not worth training on.
    n_skip = max(len(prefix) - 1, 0)
    order = sorted(range(n), key=lambda i: -len(enc[i]))
    bar = tqdm(total=n * max_new_tokens, unit="tok", desc="writing answers", disable=not progress, dynamic_ncols=True,
               file=sys.stderr)
    for j in range(0, n, batch):
        idx = order[j : j + batch]
        resp, feats = _batched_generate(target, [enc[i] for i in idx], max_new_tokens, eos, pad, sample=False, features=True,
                                        on_step=bar.update)
        bar.update((j + len(idx)) * max_new_tokens - bar.n)  # the tokens its EOS-ended answers did not take
        bar.set_postfix_str(f"answers {j + len(idx)}/{n}")
        for i, r, f in zip(idx, resp, feats):
            # The generating passes saw every token but the last one: keep the positions with a feature.
            ids = (enc[i] + r)[: f.shape[0]]
            examples.append({"prompt": prompts[i], "ids": ids, "n_prompt": len(enc[i]), "n_skip": n_skip, "features": f})
        log(f"responses: {len(examples)}/{n} ({time.perf_counter() - t0:.0f} s)")
    bar.close()
    log(f"features: {n} sequences, {sum(len(e['ids']) for e in examples)} tokens ({time.perf_counter() - t0:.0f} s)")
    return examples, {"dropped": dropped, "seconds": time.perf_counter() - t0}


def draft_vocabulary(examples, size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The ``size`` most frequent token ids of the examples, plus ``always`` (e.g. EOS).

    Frequency = observed count + the target's expected count (the sum of its next-token
    probabilities over every position, ``e["mass"]`` when present): with a few ten thousand
    tokens of data, the expected count also ranks the many tokens the greedy text happens not
    to contain but the target often predicts.  Ties go to the lower id.
    """
    score = torch.zeros(vocab_size, dtype=torch.float64)
    for e in examples:
        score += torch.bincount(torch.tensor(e["ids"]), minlength=vocab_size).double()
        if "mass" in e:
            score += e["mass"].double()
    size = min(int(size), vocab_size)
    for t in always:
        score[t] = float("inf")  # EOS etc. must be draftable
    order = sorted(range(vocab_size), key=lambda i: (-float(score[i]), i))
    return torch.tensor(order[:size]).sort().values


# ----------------------------------------------------------------------------- training batches


def radii_of(target, examples, criterion, log, progress: bool = False) -> None:
    """In place: each example's radius r_t = radius(criterion, p_t) at every position ([T], float32) and
    ``mass``, the target's expected token counts over its positions ([V]); skips examples that have them.
    ``progress``: a bar on stderr counting the examples."""
    from tqdm.auto import tqdm  # optional: models extra

    W = target.get_output_embeddings().weight
    t0 = time.perf_counter()
    for e in tqdm(examples, unit="example", desc="radii", disable=not progress, dynamic_ncols=True, file=sys.stderr):
        if "radius" in e:
            continue
        f = e["features"].to(W.dtype)
        with torch.no_grad():
            z = f @ W.T  # [T, V]: the target's logits, recomputed from its features
            e["radius"] = torch.as_tensor(radius(criterion, logits=z.float())).float()
            # the target's expected token counts here: ranks the draft vocabulary (smoother than counts)
            e["mass"] = torch.softmax(z.float(), -1).sum(0)
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
    """(ids [B, T], features [B, T, H], lengths [B], radii [B, T], skip [B]) of examples ``idx``, right-padded with zeros."""
    L = [len(examples[i]["ids"]) for i in idx]
    T = max(L)
    H = examples[idx[0]]["features"].shape[1]
    ids = torch.zeros(len(idx), T, dtype=torch.long)
    feats = torch.zeros(len(idx), T, H, dtype=dtype)
    radii = torch.zeros(len(idx), T)
    skip = torch.tensor([examples[i].get("n_skip", 0) for i in idx], device=device)
    for b, i in enumerate(idx):
        e = examples[i]
        n = L[b]
        ids[b, :n] = torch.tensor(e["ids"])
        feats[b, :n] = e["features"].to(dtype)
        radii[b, :n] = e["radius"]
    return ids.to(device), feats.to(device), torch.tensor(L, device=device), radii.to(device), skip
