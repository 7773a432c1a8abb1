"""Predicted quality of an AI 100 compile before compiling: the retained-state decoder (export.py) run in
torch with MXFP6 E2M3 on every constant MatMul weight (the linear layers and lm_head; the embedding is a
Gather and stays as it is) and MXINT8 on the K/V written to the cache, against transformers fp32 on the
same ids: top-1 agreement, KL, and perplexity on the parity texts. Compute stays fp32 here; the device
computes in fp16 (`-convert-to-fp16`), which this does not model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def predict(model_dir: Path, sequences: list[list[int]], *, mxfp6: bool = True, mxint8: bool = True) -> dict[str, Any]:
    import numpy as np
    import torch

    from ... import parity, reference
    from .export import _decoder
    from .mx import fake_mxfp6, fake_mxint8

    model = reference.load_model(model_dir)
    with torch.inference_mode():
        ref = [model(torch.tensor([s])).logits[0].float().numpy() for s in sequences]
        if mxfp6:
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):  # lm_head included; tied weights get a copy
                    module.weight = torch.nn.Parameter(fake_mxfp6(module.weight.detach().clone()), requires_grad=False)
        decoder, n_kv, head_dim, _ = _decoder(model, kv_transform=fake_mxint8 if mxint8 else None)
        decoder.all_positions = True
        got = []
        for s in sequences:
            past = [torch.zeros(1, n_kv, len(s), head_dim) for _ in range(2 * len(decoder.layers))]
            got.append(decoder(torch.tensor([s]), torch.arange(len(s)).unsqueeze(0), *past)[0][0].float().numpy())
    total = parity.merge([parity.compare(r, g) for r, g in zip(ref, got)])

    def ppl(all_logits: list[np.ndarray]) -> float:
        nll, n = 0.0, 0
        for s, lg in zip(sequences, all_logits):
            lp = parity.log_softmax(lg[:-1])
            nll -= float(lp[np.arange(len(s) - 1), s[1:]].sum())
            n += len(s) - 1
        return math.exp(nll / n)

    p_ref, p_got = ppl(ref), ppl(got)
    return {"positions": total.positions, "top1": round(total.top1_agreement, 6), "kl": float(f"{total.mean_kl:.6g}"),
            "max_abs_logit_delta": float(f"{total.max_abs_logit_delta:.6g}"), "ppl_fp32": round(p_ref, 4),
            "ppl": round(p_got, 4), "ppl_delta": float(f"{(p_got - p_ref) / p_ref:.6g}"),
            "emulated": [n for n, on in (("mxfp6 weights", mxfp6), ("mxint8 kv cache", mxint8)) if on]}
