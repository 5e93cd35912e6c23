"""What a draft vocabulary saves: one drafting step of the pair's 0.5B drafter over its whole output layer,
over its shipped token map (``drafting/draft_vocab.py``: 32,768 rows plus the sequence's own tokens) and
over the first N rows, next to its decoder layers alone and the 1.5B target's one-row pass.

A prompt of ``--context`` tokens is prefilled once per model; then one-row passes take turns between
the variants (``--repeats`` rounds), each cropped back so the context stays put.  Wall-clock medians.

    python benchmarks/bench_draft_vocab.py [--context 300] [--prefix 32768] [--repeats 25] [--threads 2]

Last lines, ``name=value``: ``drafter_step_ms[whole|map|prefix|decoder]``, ``target_step_ms``,
``drafter_vs_target[whole|map]`` (a drafting step over a target pass), ``map_saves`` (1 - map / whole).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--prefix", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from draftcert.drafting.draft_vocab import DraftVocabulary, VocabHead, shipped_vocab
    from draftcert.models import load_target
    from draftcert.models.hf import model_forward, new_cache
    from draftcert.models.tree_attention import crop_cache

    drafter, _ = load_target("qwen2.5-coder-0.5b")
    target, _ = load_target("qwen2.5-coder-1.5b")
    prompt = list(range(1000, 1000 + args.context))
    vocab = shipped_vocab("qwen2.5-coder-0.5b")
    mapped = VocabHead(drafter, vocab)
    mapped.add(prompt)  # the sequence's tokens join the map, as a decode's would
    prefix = VocabHead(drafter, DraftVocabulary.prefix(args.prefix, vocab.vocab_size))

    def decoder_only(h):  # the decoder layers and final norm; no output layer
        return h

    variants = {"whole": (drafter, None), "map": (drafter, mapped), "prefix": (drafter, prefix),
                "decoder": (drafter, decoder_only), "target": (target, None)}
    caches = {}
    with torch.inference_mode():
        for m in (drafter, target):
            caches[id(m)] = new_cache(m)
            model_forward(m, caches[id(m)], prompt, 1)
        times = {k: [] for k in variants}
        for r in range(args.repeats + 1):
            for name, (m, head) in variants.items():
                cache = caches[id(m)]
                t = time.perf_counter()
                model_forward(m, cache, [5], 1, head=head)
                dt = time.perf_counter() - t
                crop_cache(cache, args.context)
                if r:  # the first round warms each variant up
                    times[name].append(dt)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"context={args.context} prefix={args.prefix} map={len(vocab)}+{mapped.extra.numel()} repeats={args.repeats} "
          f"threads={args.threads}")
    for k in ("whole", "map", "prefix", "decoder"):
        print(f"drafter_step_ms[{k}]={ms[k]:.2f}")
    print(f"target_step_ms={ms['target']:.2f}")
    for k in ("whole", "map"):
        print(f"drafter_vs_target[{k}]={ms[k] / ms['target']:.3f}")
    print(f"map_saves={1 - ms['map'] / ms['whole']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
