"""EAGLE-3's fused features against the shipped feature drafter, trained on the same data: does fusing the
target's low and middle layers with its final feature raise the drafter's acceptance?

    PYTHONPATH=src python benchmarks/bench_fused_features.py --run runs/embedded-7k --examples 2000 --out runs/fused-ab

``--run``: a finished ``train-drafter`` run on the embedded target (its ``data.pt``, the target's answers
and final features, and ``user_eval.pt``, its answers to the held-out user prompts), e.g. the shipped
drafter's (docs/training.md).  Step 1, kept in ``OUT/data.pt``: the run's first ``--examples`` training
examples and its last 32 (held out), with the target's outputs of decoder layers ``--layers`` at every
position (teacher-forced; default 2 and 15 of the embedded target's 30, EAGLE-3's low and middle), and
their radii and teacher terms.  Step 2: one drafter per arm, trained by ``train_drafter`` with the shipped
run's settings (certificate objective, strict, ``--epochs`` 2, lr 0.002, ttt 2) on that data, in
``OUT/ARM`` (a finished arm is kept):

    final      the shipped design: fc([embed; f]) with f the target's final feature
    fused      EAGLE-3: f = fuse([low; mid; final]), a learned Linear(3H -> H) that starts as the final feature
    fusednorm  the same with low and mid RMS-normalised first (the residual stream grows with depth: the
               embedded target's middle layer holds values up to about 2.5e4)

The arms differ only in the drafter's class, which this script defines (the library has no fused drafter:
it did not pay, below); ``train_drafter``'s collate and unroll are wrapped to hand the fused arms the three
features.  Each arm's acceptance by depth on the user prompts is ``user_eval.acceptance_by_depth`` of the
trained float drafter.  Last lines, per arm: ``<arm>_heldout_accept1=`` (teacher-forced, ShareGPT held out),
``<arm>_user_accept1=`` .. ``3``, ``<arm>_user_mean_run=``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ARMS = ("final", "fused", "fusednorm")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a train-drafter run directory (data.pt, user_eval.pt)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--layers", default="2,15", help="the low and middle decoder layers fused with the final feature")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    low, mid = (int(x) for x in args.layers.split(","))
    arms = [a.strip() for a in args.arms.split(",")]
    if any(a not in ARMS for a in arms):
        ap.error(f"--arms: choose from {', '.join(ARMS)}")
    for name in ("data.pt", "user_eval.pt"):
        if not (args.run / name).is_file():
            ap.error(f"--run: {args.run / name} is missing (a finished train-drafter run has it)")

    from draftcert.criteria import parse_criterion
    from draftcert.models import eagle
    from draftcert.models.loading import load_target
    from draftcert.train import loop, objective
    from draftcert.train.distill_data import collate as base_collate, radii_of
    from draftcert.train.user_eval import acceptance_by_depth

    target, tok = load_target(None)
    args.out.mkdir(parents=True, exist_ok=True)

    @torch.no_grad()
    def add_layers(examples, batch=8):  # e["low_mid"] [T, 2H]: the two layers' outputs, teacher-forced
        order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
        for j in range(0, len(order), batch):
            idx = order[j: j + batch]
            lengths = [len(examples[i]["ids"]) for i in idx]
            ids = torch.zeros(len(idx), max(lengths), dtype=torch.long)  # right-padded: causal rows see no padding
            for b, i in enumerate(idx):
                ids[b, : lengths[b]] = torch.tensor(examples[i]["ids"])
            hs = target.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states  # [0]: embeddings
            for b, i in enumerate(idx):
                n = examples[i]["features"].shape[0]
                examples[i]["low_mid"] = torch.cat([hs[low + 1][b, :n], hs[mid + 1][b, :n]], -1).float().clone()

    data_path, users_path = args.out / "data.pt", args.out / "user_eval.pt"
    t0 = time.perf_counter()
    if not data_path.is_file():
        data = torch.load(args.run / "data.pt", weights_only=False)
        data["examples"] = data["examples"][: args.examples] + data["examples"][-32:]
        add_layers(data["examples"])
        radii_of(target, data["examples"], parse_criterion("strict"), print)
        torch.save(data, data_path)
        users = torch.load(args.run / "user_eval.pt", weights_only=False)["examples"]
        add_layers(users)
        torch.save(users, users_path)
        print(f"data: {len(data['examples'])} examples with layers {low} and {mid} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        del data
    users = torch.load(users_path, weights_only=False)

    state = {"arm": None, "low_mid": None, "drafter": None}

    class FusedDrafter(eagle.EagleDrafter):
        """A feature of width 3H (low, mid, final) enters through ``fuse``; the drafter's own (H) as before."""

        def __init__(self, target, vocab_ids, **kw):
            super().__init__(target, vocab_ids, **kw)
            H = self.hidden_size
            self.fuse = torch.nn.Linear(3 * H, H, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, 2 * H:] = torch.eye(H)

        def step(self, tokens, feats, *a, **kw):
            if feats.shape[-1] != self.hidden_size:
                if state["arm"] == "fusednorm":
                    H = self.hidden_size
                    rms = lambda x: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
                    feats = torch.cat([rms(feats[..., :H]), rms(feats[..., H: 2 * H]), feats[..., 2 * H:]], -1)
                feats = self.fuse(feats)
            return super().step(tokens, feats, *a, **kw)

    def collate(examples, idx, dtype, device):  # the batch as ever; a fused arm's low/mid features kept aside
        batch = base_collate(examples, idx, dtype, device)
        if state["arm"] != "final":
            f = batch[1]
            lm = torch.zeros(f.shape[0], f.shape[1], 2 * f.shape[2], dtype=dtype)
            for b, i in enumerate(idx):
                x = examples[i]["low_mid"]
                lm[b, : x.shape[0]] = x.to(dtype)
            state["low_mid"] = lm.to(device)
        return batch

    base_unrolled = objective.unrolled

    def unrolled(drafter, ids, feats, lengths, ttt, head_w):  # the teacher keeps the final feature
        if state["arm"] != "final" and feats.shape[-1] == drafter.hidden_size:
            feats = torch.cat([state["low_mid"].to(feats.dtype), feats], -1)
        return base_unrolled(drafter, ids, feats, lengths, ttt, head_w)

    def save_eagle(drafter, path, **kw):  # the fused class is this script's: kept in memory, a state dict on disk
        state["drafter"] = drafter
        torch.save(drafter.state_dict(), Path(path).with_suffix(".pt"))
        Path(path).write_text("see drafter.pt\n")
        return Path(path)

    loop.collate = objective.collate = collate
    objective.unrolled = unrolled
    loop.save_eagle = save_eagle
    loop.load_eagle = lambda path, target, dtype=None: state["drafter"]
    results = {}
    for arm in arms:
        state["arm"] = arm
        loop.EagleDrafter = eagle.EagleDrafter if arm == "final" else FusedDrafter
        out = args.out / arm
        done = out / "result.json"
        if done.is_file():
            results[arm] = json.loads(done.read_text())
            continue
        cfg = loop.TrainConfig(objective="certificate", criterion="strict", examples=args.examples, heldout_examples=32,
                               epochs=args.epochs, ttt=2, lr=0.002, warmup=20, data=str(data_path),
                               prompts="sharegpt-train", user_eval_prompts=0)
        t0 = time.perf_counter()
        if loop.train_drafter(cfg, out, target=target, tokenizer=tok, progress=False, quiet=True) is None:
            raise SystemExit(f"{arm}: training stopped early; rerun to resume")
        drafter = state["drafter"].eval()
        ex = users if arm == "final" else [{**e, "features": torch.cat([e["low_mid"], e["features"]], -1)} for e in users]
        heldout = json.loads((out / "train.json").read_text())["heldout_eval_fp16"]
        results[arm] = {"heldout": heldout, "user": acceptance_by_depth(drafter, ex, 6),
                        "seconds": round(time.perf_counter() - t0)}
        done.write_text(json.dumps(results[arm], indent=1))
        print(f"{arm}: trained and evaluated in {results[arm]['seconds']} s", flush=True)
    print(f"examples={args.examples}")
    print(f"layers={low},{mid}")
    for arm, r in results.items():
        print(f"{arm}_heldout_accept1={r['heldout']['accept@1']:.4f}")
        for d in (1, 2, 3):
            print(f"{arm}_user_accept{d}={r['user'][f'accept@{d}']:.4f}")
        print(f"{arm}_user_mean_run={r['user']['mean_run']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
