"""How often does a derived drafter's greedy token equal the target's?  (Choosing DEFAULT_DRAFTER.)

Protocol (teacher forced, one forward pass per sequence and model):
1. For each of the first N MT-Bench prompts (chat template applied), the target generates up to
   T tokens greedily (KV cache, stops early at EOS).
2. Every model (target and each drafter) runs one forward pass over prompt + continuation; at
   each continuation position t we compare argmax q_t (drafter) with argmax p_t (target), both
   conditioned on the same target-generated prefix.  accept_rate = matches / positions: the
   strict rule's teacher-forced acceptance rate, the profile report's ``accept_rate`` for strict
   (docs/metrics.md; vLLM has no name for it: its rates count drafts of a decode, not every
   position of the greedy path).
3. rel_time = the drafter's forward time / the target's on the same batch (CPU, 1 thread by
   default): a rough per-token cost ratio, only meaningful on an otherwise idle machine (on a
   shared one it mostly measures the neighbours).  The structural cost of a skip drafter is
   (layers kept) / (layers) of the decoder; a quant drafter runs dequantised weights (ratio 1).

Drafters measured: skip of each single middle layer, the best k single layers skipped together
(k = 2, 4, 6, ranked by single-skip accept_rate), self:quant=4 and =3 per output channel and with group=32, and DEFAULT_DRAFTER.
Prints one line per drafter and ``default_drafter_accept_rate=X`` last.

    PYTHONPATH=src python benchmarks/bench_drafters.py [--prompts 20] [--tokens 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch


def continuation_batch(model, tokenizer, prompts, max_new_tokens):
    """Greedy continuations; returns (padded ids (B, L), list of (start, end) scored spans)."""
    from draftcert.prompts import encode_prompt

    seqs, spans = [], []
    for p in prompts:
        ids = torch.tensor([encode_prompt(tokenizer, p.text)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        )[0]
        n_prompt = ids.shape[1]
        seqs.append(out)
        # logits at position i predict token i+1: the continuation tokens n_prompt..len-1 are
        # predicted at positions n_prompt-1 .. len-2
        spans.append((n_prompt - 1, len(out) - 1))
    width = max(len(s) for s in seqs)
    batch = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s  # right padding: causal attention never lets real tokens see pads
    return batch, spans


@torch.inference_mode()
def greedy_at_spans(model, batch, spans, chunk=5):
    """argmax of the model's logits at the scored positions, (positions,) long; and seconds."""
    head = model.get_output_embeddings()
    picks = []
    t0 = time.perf_counter()
    for lo in range(0, batch.shape[0], chunk):
        hidden = model.model(input_ids=batch[lo : lo + chunk]).last_hidden_state
        rows = [hidden[i, a:b] for i, (a, b) in enumerate(spans[lo : lo + chunk])]
        # the LM head only on scored positions: same logits, a fraction of the (V x d) matmuls
        picks.append(head(torch.cat(rows)).argmax(-1))
    return torch.cat(picks), time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target spec (default: embedded SmolLM2-135M)")
    ap.add_argument("--prompts", type=int, default=20, help="number of MT-Bench prompts")
    ap.add_argument("--tokens", type=int, default=32, help="greedy target tokens per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", default=None, help="single-skip scan range a-b (default: middle 2/3)")
    ap.add_argument("--scan-only", action="store_true", help="only the single-layer skip scan")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from draftcert.models import DEFAULT_DRAFTER, derive_drafter, load_target
    from draftcert.prompts import load_prompts

    target, tok = load_target(args.target)
    n_layers = target.config.num_hidden_layers
    prompts = load_prompts("mt-bench", limit=args.prompts)
    batch, spans = continuation_batch(target, tok, prompts, args.tokens)
    greedy_at_spans(target, batch[:1], spans[:1])  # warm-up, so timings compare like with like
    ref, t_target = greedy_at_spans(target, batch, spans)
    # sanity: teacher-forced target argmax reproduces its own KV-cached greedy tokens
    gen = torch.cat([batch[i, a + 1 : b + 1] for i, (a, b) in enumerate(spans)])
    print(
        f"target layers={n_layers} positions={ref.numel()} "
        f"self_consistency={(gen == ref).double().mean().item():.4f} forward_s={t_target:.2f}",
        flush=True,
    )

    results: dict[str, tuple[float, float]] = {}

    def measure(spec: str) -> float:
        if spec in results:
            return results[spec][0]
        drafter = derive_drafter(target, spec)
        got, secs = greedy_at_spans(drafter, batch, spans)
        del drafter
        gc.collect()
        agree = (got == ref).double().mean().item()
        results[spec] = (agree, secs / t_target)
        print(f"drafter={spec} accept_rate={agree:.4f} rel_time={secs / t_target:.2f}", flush=True)
        return agree

    if args.layers:
        a, b = (int(x) for x in args.layers.split("-"))
    else:
        a, b = n_layers // 6, n_layers - 1 - n_layers // 6
    single = {j: measure(f"self:skip={j}") for j in range(a, b + 1)}
    ranked = sorted(single, key=lambda j: (-single[j], j))
    best = ranked[0]
    print(f"best_single_skip=self:skip={best} accept_rate={single[best]:.4f}", flush=True)
    if args.scan_only:
        return 0
    for k in (2, 4, 6):
        layers = ",".join(str(j) for j in sorted(ranked[:k]))
        measure(f"self:skip={layers}")
    for bits in (4, 3):
        measure(f"self:quant={bits}")  # per output channel
        measure(f"self:quant={bits},group=32")  # the Q4_1 block size the target was stored in
    measure(DEFAULT_DRAFTER)
    print(f"default_drafter={DEFAULT_DRAFTER}")
    print(f"default_drafter_accept_rate={results[DEFAULT_DRAFTER][0]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
