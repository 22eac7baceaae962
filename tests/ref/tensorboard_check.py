#!/usr/bin/env python3
"""tensorboard_check.py — the oracle of it_export's TensorBoard test: reads the event files
of LOGDIR/RUN with TensorBoard's own reader (tensorboard's EventAccumulator, not the
tensorboardX writer the converter uses) and checks them against the metrics file they came
from: every step record's loss, img_s and lr, and every evaluation's accuracy and test loss,
at its step, equal within float32 rounding; the config text present. Prints what it
compared; exit 1 on the first difference.
"""
import argparse
import json
import math
import sys

from tensorboard.backend.event_processing import event_accumulator as ea


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--run", required=True, help="LOGDIR/trainer-I")
    a = ap.parse_args()
    acc = ea.EventAccumulator(a.run, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags["scalars"]}
    want = {"loss": "train/loss", "img_s": "train/img_per_s", "lr": "train/lr",
            "accuracy": "eval/accuracy", "test_loss": "eval/loss"}
    n = 0
    with open(a.metrics) as f:
        for line in f:
            r = json.loads(line)
            if r["type"] != "step":
                continue
            for field, tag in want.items():
                v = r.get(field)
                if v is None:
                    continue
                got = scalars.get(tag, {}).get(r["step"])
                if got is None or not math.isclose(got, v, rel_tol=1e-6, abs_tol=1e-30):
                    print(f"tensorboard_check: step {r['step']} {tag}: events have {got}, "
                          f"the metrics file {v}")
                    return 1
                n += 1
    texts = tags.get("tensors", [])
    if not any(t.startswith("config") for t in texts):
        print(f"tensorboard_check: no config text (tensors: {texts})")
        return 1
    evals = len(scalars.get("eval/accuracy", {}))
    print(f"tensorboard_check: {n} values equal, {evals} evaluations, tags "
          f"{sorted(scalars)}")
    return 0 if n and evals else 1


if __name__ == "__main__":
    sys.exit(main())
