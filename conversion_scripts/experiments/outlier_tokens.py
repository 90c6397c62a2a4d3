"""List, per decoder layer, the held-out tokens whose residual RMS exceeds 4x the median (BOS-prefixed blocks).

python -m conversion_scripts.experiments.outlier_tokens > conversion_scripts/experiments/reports/outlier_tokens.txt
"""

import torch

from .smollm2_fidelity import load_smollm2, stdlib_blocks

torch.set_num_threads(1)
model, tok = load_smollm2()
train, held = stdlib_blocks(tok, 4, 8, 128)
with torch.no_grad():
    out = model(input_ids=held, output_hidden_states=True)
for layer in [2, 4, 8, 12, 16, 20, 25, 29]:
    h = out.hidden_states[layer]
    r = h.pow(2).mean(-1).sqrt()
    med = r[:, 1:].median()
    idx = (r > 4 * med).nonzero().tolist()
    desc = [(b, p, tok.decode([int(held[b, p])]), round(float(r[b, p] / med), 1)) for b, p in idx]
    print(layer, len(idx), desc[:30], flush=True)
