"""Held-out perplexity and MTP acceptance of a checkpoint, through tandem's own layer program.

    python scripts/demo/eval_ppl.py [--model ranks/demo_model] [--ids scripts/demo/heldout_sample.npy]
                                    [--device cpu|cuda] [--dtype float32|bfloat16] [--out result.json]

The ids file holds windows of held-out tokens ([W, L+2] uint16, made by --make-sample from the
corpus' held-out split). Each window is prefilled in one step (logits at every position); the MTP
layer then runs over the same columns. Perplexity is exp(mean NLL of token t+1 given 0..t); MTP
greedy acceptance is the share of positions where the MTP argmax equals the main model's argmax for
the token after next, among positions where the main model's own next-token argmax was right (the
acceptance of a one-token draft under greedy decoding). The same numbers come out on any device:
it is the reference backend either way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ranks.model import Batch, HybridModel  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def make_sample(heldout: str, out: str, windows: int, length: int) -> None:
    ids = np.load(heldout, mmap_mode="r")
    span = length + 2
    starts = np.linspace(0, len(ids) - span, windows).astype(np.int64)
    np.save(out, np.stack([np.asarray(ids[s:s + span]) for s in starts]).astype(np.uint16))


@torch.inference_mode()
def evaluate(model: HybridModel, windows: np.ndarray) -> dict:
    nll, count, accepted, eligible = 0.0, 0, 0, 0
    for w in windows:
        ids = torch.from_numpy(w.astype(np.int64))
        L = len(ids) - 2
        pages = -(-(L + 1) // 64)
        table = torch.arange(pages, dtype=torch.int32)[None]
        state = model.new_state(1, pages)
        out = model.forward(Batch(ids[:L], [L], [0], [0], table), state, logits="all")
        logp = torch.log_softmax(out.logits.double().cpu(), dim=-1)
        target = ids[1:L + 1]
        nll -= float(logp[torch.arange(L), target].sum())
        count += L
        if model.has_mtp:
            # column t: token t+1 with the hidden of position t -> predicts token t+2
            mtp = model.mtp_forward(Batch(ids[1:L + 1], [L], [0], [0], table), out.hidden, state).logits.cpu()
            main_next = out.logits.argmax(-1).cpu()                  # main model's guess for t+1
            right = main_next[:L - 1] == target[:L - 1]              # guess for t+1 right, t < L-1
            main_after = main_next[1:L]                              # main model's argmax for t+2
            draft = mtp.argmax(-1)[:L - 1]
            accepted += int(((draft == main_after) & right).sum())
            eligible += int(right.sum())
    return dict(tokens=count, perplexity=math.exp(nll / count), nll=nll / count,
                mtp_greedy_acceptance=accepted / eligible if eligible else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(REPO, "ranks", "demo_model"))
    ap.add_argument("--ids", default=os.path.join(HERE, "heldout_sample.npy"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--make-sample", metavar="HELDOUT_NPY", help="write --ids from a corpus held-out split and exit")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--length", type=int, default=1024)
    args = ap.parse_args()
    if args.make_sample:
        make_sample(args.make_sample, args.ids, args.windows, args.length)
        print(f"wrote {args.ids}")
        return 0
    t0 = time.time()
    model = HybridModel.from_dir(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    result = evaluate(model, np.load(args.ids))
    result.update(model=os.path.relpath(args.model, REPO), device=str(model.device), dtype=args.dtype,
                  seconds=round(time.time() - t0, 1),
                  device_name=torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu")
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
