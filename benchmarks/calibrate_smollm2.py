"""The SmolLM2-135M calibration behind what kvcodec ships for that model.

    python benchmarks/calibrate_smollm2.py                 # the allocations of kvcodec.hf.presets.CALIBRATED
    python benchmarks/calibrate_smollm2.py --fit kvcodec/data/smollm2_kv_fit.json --force   # the shipped fit

Without ``--fit`` it prints the per-(layer, part, bits) KL sensitivity as JSON, then one line per
preset in the form of ``CALIBRATED``'s entries (about 30-40 minutes on 2 busy CPU cores). With
``--fit PATH`` it writes the fitted statistics ``kvcodec.hf.fitted`` loads as "smollm2-135m"
(about 2 minutes); an existing PATH is replaced only with ``--force`` (``kvcodec.safe_write``).
The passes themselves are ``kvcodec.hf.calibrate``'s; this script picks the model and the text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # a source checkout without pip install

import smollm2  # noqa: E402
from kvcodec.hf.calibrate import DEFAULT_LEVELS, fit_statistics, layer_sensitivity, predicted_kl  # noqa: E402


def smollm2_sensitivity(progress=print) -> dict:
    """The calibration pass behind kvcodec.hf.presets.CALIBRATED: SmolLM2-135M bf16, two 576-token
    segments of ``real_text("mixed")`` (the project's own tuning text, never the benchmark's held-out
    texts), prefix 512, 64 scored tokens each (about 30-40 minutes on 2 busy CPU cores)."""
    model = smollm2.load_model(torch.bfloat16)
    ids = smollm2.load_tokenizer()(smollm2.real_text("mixed"), return_tensors="pt").input_ids[0]
    segments = torch.stack([ids[:576], ids[4000:4576]])
    return layer_sensitivity(model, segments, prefix=512, levels=DEFAULT_LEVELS, configs_per_forward=6,
                             progress=lambda a, b: progress(f"{a}/{b}"))


def smollm2_fit():
    """The fit behind kvcodec/data/smollm2_kv_fit.json: SmolLM2-135M bf16, two 1,024-token segments of
    ``real_text("mixed")`` (offsets 20,000 and 60,000: neither the allocation's nor the lever benchmark's)."""
    model = smollm2.load_model(torch.bfloat16)
    ids = smollm2.load_tokenizer()(smollm2.real_text("mixed"), return_tensors="pt").input_ids[0]
    return fit_statistics(model, torch.stack([ids[20_000:21_024], ids[60_000:61_024]]))


def main(argv=None) -> int:
    from kvcodec.hf.presets import PRESETS, allocation_for
    from kvcodec.safe_write import write_bytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", metavar="PATH", help="write the fitted statistics (JSON) to PATH instead")
    ap.add_argument("--force", action="store_true", help="replace an existing --fit PATH")
    args = ap.parse_args(argv)
    if args.fit:
        text = json.dumps(smollm2_fit().to_json(), separators=(",", ":"))
        write_bytes(args.fit, text.encode("utf-8"), overwrite=args.force)
        return 0
    sens = smollm2_sensitivity()
    print(json.dumps(sens))
    for name, budget in PRESETS.items():
        kb, vb = allocation_for(budget, sens, 64)
        print(f'"{name}": ({tuple(kb)}, {tuple(vb)}),  # predicted KL {predicted_kl(sens, kb, vb):.3f}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
