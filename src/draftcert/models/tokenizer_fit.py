"""A drafter loaded from its own files fitted to its target: the two tokenizers compared before any work.

:func:`fit_drafter` (``load_drafter`` runs it on every drafter it loads from a path, a hub id or a
GGUF file) compares the target's and the drafter's tokenizers:

* the token -> id maps: a token with another id, or tokens only one side has, would make the
  drafter draft other tokens than it means and the certificates compare unrelated tokens;
* the ids of a probe text (``PROBE``): the same vocabulary split another way (normaliser,
  pre-tokeniser) feeds the drafter other text than the target reads;
* the special tokens: another beginning or end of sequence (bos, eos) is another convention;
* the output layers' rows: every token id must be a row of both (a target token the drafter has
  no row for cannot be fed to it).

Any of these is a ``ValueError`` naming the difference (the command line prints it as one error
line).  Two differences are harmless, handled and said once (one ``draftcert:`` line on stderr):
output layers of different row counts where every row past the shorter one is padding (no token of
either tokenizer: GGUF files pad the vocabulary to a multiple, e.g. Qwen2.5-7B's 152,064 rows over
151,665 tokens where the 1.5B has 151,936), and another padding id (padded slots are masked; draftcert
pads with the target's).  For padding rows the drafter's output layer is fitted to the target's row
count (:class:`PaddedRows`): cut to the target's first rows, or extended with rows whose logit is
-inf (q = 0 on a padding row: the drafter never proposes it; strict stays lossless), and its input
embedding reads a padding id it has no row for as zeros (:class:`PaddedEmbedding`).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..gguf.layers import GGUFLinear
from .hf import output_rows

__all__ = ["PROBE", "tokenizer_differences", "fit_drafter", "PaddedRows", "PaddedEmbedding"]

# Text whose ids both tokenizers must agree on: words, code, digits, whitespace runs, accents, CJK, emoji
PROBE = "Hello, world! Here is the answer: def f(x):\n    return x * 2  # 3.14159\n\tnaïve café 日本語 🙂 <tag> The END."


def _token_name(tok, i: int) -> str:
    try:
        return repr(tok.convert_ids_to_tokens(int(i)))
    except Exception:  # noqa: BLE001 - a tokenizer without that id
        return "none"


def _vocab_difference(t_tok, d_tok) -> str | None:
    tv, dv = t_tok.get_vocab(), d_tok.get_vocab()
    if tv == dv:
        return None
    t_ids = {i: s for s, i in tv.items()}
    d_ids = {i: s for s, i in dv.items()}
    for i in sorted(set(t_ids) & set(d_ids)):
        if t_ids[i] != d_ids[i]:
            return f"token id {i} is {t_ids[i]!r} in the target's tokenizer and {d_ids[i]!r} in the drafter's"
    only_t, only_d = sorted(set(t_ids) - set(d_ids)), sorted(set(d_ids) - set(t_ids))
    side, only, ids = ("target", "drafter", only_t) if only_t else ("drafter", "target", only_d)
    shown = ", ".join(f"{i} {(t_ids if side == 'target' else d_ids)[i]!r}" for i in ids[:3])
    return (f"the target's tokenizer has {len(tv)} tokens and the drafter's {len(dv)}: the {side}'s has "
            f"{len(ids)} the {only}'s lacks (ids {shown}{', ...' if len(ids) > 3 else ''})")


def tokenizer_differences(t_tok, d_tok) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of a drafter's tokenizer against its target's: problems make the pair wrong
    (another vocabulary, other ids for the probe text, another bos or eos), notes are harmless (another
    padding id)."""
    problems, notes = [], []
    vocab = _vocab_difference(t_tok, d_tok)
    if vocab:
        problems.append(vocab)
    t_ids = list(t_tok(PROBE, add_special_tokens=False)["input_ids"])
    d_ids = list(d_tok(PROBE, add_special_tokens=False)["input_ids"])
    if not vocab and t_ids != d_ids:
        at = next((j for j, (a, b) in enumerate(zip(t_ids, d_ids)) if a != b), min(len(t_ids), len(d_ids)))
        problems.append(f"the probe text {PROBE!r} encodes to {len(t_ids)} ids with the target's tokenizer and "
                        f"{len(d_ids)} with the drafter's, first different at position {at} "
                        f"({t_ids[at:at + 3]} vs {d_ids[at:at + 3]})")
    for name in ("bos", "eos"):
        a, b = getattr(t_tok, f"{name}_token_id", None), getattr(d_tok, f"{name}_token_id", None)
        if a != b:
            problems.append(f"the {name} token is id {a} ({_token_name(t_tok, a) if a is not None else 'none'}) for "
                            f"the target and {b} ({_token_name(d_tok, b) if b is not None else 'none'}) for the drafter")
    a, b = getattr(t_tok, "pad_token_id", None), getattr(d_tok, "pad_token_id", None)
    if a != b:
        notes.append(f"the padding id is {a} for the target and {b} for the drafter (padded slots are masked; "
                     "draftcert pads with the target's)")
    return problems, notes


class PaddedEmbedding(nn.Module):
    """An input embedding of ``rows`` ids: ``emb``'s rows, and zeros for the padding ids past them (a
    target with padding rows could emit one: the drafter reads it as a zero vector, a draft input
    like any other; strict decoding stays lossless)."""

    def __init__(self, emb: nn.Module, rows: int):
        super().__init__()
        self.emb, self.num_embeddings = emb, int(rows)
        self.embedding_dim = getattr(emb, "embedding_dim", None)
        self.padding_idx = getattr(emb, "padding_idx", None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # noqa: D102
        inside = ids < self.emb.num_embeddings
        out = self.emb(torch.where(inside, ids, torch.zeros_like(ids)))
        return torch.where(inside.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))


class PaddedRows(nn.Module):
    """An output layer of ``rows`` outputs: ``head``'s first ``rows`` where it has more, else all of
    ``head``'s followed by -inf logits (q = 0) for the padding rows it lacks."""

    def __init__(self, head: nn.Module, rows: int):
        super().__init__()
        self.head, self.out_features = head, int(rows)
        self.in_features = getattr(head, "in_features", None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # noqa: D102
        y = self.head(h)
        n = y.shape[-1]
        if n >= self.out_features:
            return y[..., :self.out_features]
        return torch.cat([y, y.new_full((*y.shape[:-1], self.out_features - n), float("-inf"))], dim=-1)


def _fit_rows(drafter, rows: int) -> None:
    """The drafter's output layer answering for ``rows`` outputs (its first rows where it has more)."""
    head = drafter.get_output_embeddings()
    fitted = None
    if isinstance(head, GGUFLinear) and head.out_features > rows:
        first = head.first_rows(rows)
        fitted = first if first.out_features == rows else None
    elif type(head) is nn.Linear and head.out_features > rows:
        fitted = nn.Linear(head.in_features, rows, bias=head.bias is not None, device=head.weight.device,
                           dtype=head.weight.dtype)
        fitted.weight = nn.Parameter(head.weight[:rows], requires_grad=False)  # a view: the tie (if any) kept
        if head.bias is not None:
            fitted.bias = nn.Parameter(head.bias[:rows], requires_grad=False)
    drafter.set_output_embeddings(fitted if fitted is not None else PaddedRows(head, rows))
    emb = drafter.get_input_embeddings()
    if getattr(emb, "num_embeddings", rows) < rows:
        drafter.set_input_embeddings(PaddedEmbedding(emb, rows))
    drafter.config.vocab_size = rows


def fit_drafter(target, t_tok, drafter, d_tok, *, quiet: bool = False):
    """``drafter`` checked against ``target`` (module docstring) and fitted to its output rows where
    they differ by padding only; ValueError naming every problem."""
    problems, notes = ([], []) if t_tok is None or d_tok is None or t_tok is d_tok else tokenizer_differences(t_tok, d_tok)
    t_rows, d_rows = output_rows(target), output_rows(drafter)
    n_tok = max((len(t) for t in (t_tok, d_tok) if t is not None), default=0)
    fit = False
    if t_rows is not None and d_rows is not None and t_rows != d_rows:
        if n_tok and min(t_rows, d_rows) >= n_tok:
            fit = True
            notes.append(f"the drafter's output layer has {d_rows} rows and the target's {t_rows}; the rows past "
                         f"{min(t_rows, d_rows)} are padding (the tokenizers have {n_tok} tokens): the drafter "
                         + (f"computes the target's first {t_rows}" if d_rows > t_rows else
                            f"gives the {t_rows - d_rows} padding rows it lacks q = 0 and reads those ids as zeros"))
        else:
            problems.append(f"the output layer has {t_rows} rows for the target and {d_rows} for the drafter, "
                            f"and the tokenizer has {n_tok or 'an unknown number of'} tokens: "
                            "token ids would fall outside one of them")
    if problems:
        raise ValueError("drafter: incompatible with the target: " + "; ".join(problems)
                         + ". A drafter must use exactly the target's tokenizer and vocabulary.")
    if fit:
        _fit_rows(drafter, t_rows)
    if notes and not quiet:
        print("draftcert: drafter fitted to the target: " + "; ".join(notes), file=sys.stderr, flush=True)
    return drafter
