"""Learning curve of a drafter training run (train_log.jsonl -> PNG): held-out top-1 accuracy per
draft step and the acceptance length it implies, against training tokens."""
from __future__ import annotations

import json
import sys

from draftwise.training.eagle3 import expected_acceptance_length


def load_log(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curve(log_path: str, out_png: str, title: str = "") -> list[dict]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = load_log(log_path)
    ev = [r for r in rows if "heldout_acc" in r]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    if ev:
        toks = [r["tokens"] for r in ev]
        for i in range(len(ev[0]["heldout_acc"])):
            a1.plot(toks, [r["heldout_acc"][i] for r in ev], marker="o", label=f"step {i}")
        # DFlash logs the measured block acceptance; EAGLE-3 logs the simulated greedy chain
        # acceptance (K = 3, 5, 7) - older logs only the per-step accuracies
        sims = ev[-1].get("heldout_simulated_acceptance") or {}
        if sims:
            for k in sims:
                a2.plot(toks, [(r.get("heldout_simulated_acceptance") or {}).get(k) for r in ev], marker="o",
                        label=f"chain, K={k[1:]}")
            a2.legend()
        else:
            a2.plot(toks, [r.get("heldout_acceptance_length") or expected_acceptance_length(r["heldout_acc"])
                           for r in ev], marker="o")
    a1.set_xlabel("training tokens")
    a1.set_ylabel("held-out top-1 accuracy")
    a1.legend()
    a2.set_xlabel("training tokens")
    a2.set_ylabel("held-out mean acceptance length")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return ev


if __name__ == "__main__":
    plot_curve(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
