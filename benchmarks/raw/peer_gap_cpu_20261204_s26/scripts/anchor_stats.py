"""Anchor statistics of the reference run's packed rows: flashdraft's per-document spread
against uniform sampling among the same candidates, and speculators' rule (loss_mask[a] == 1,
a < T - B, uniform, slots trained iff loss_mask[a+k] == 1). No model: the rows only."""
import sys
import numpy as np
import torch
from flashdraft.data.dataset import open_dataset
from flashdraft.train.packing import RowStream, row_seed
from flashdraft.train.blocks import anchor_candidates, block_labels, sample_anchors

data, rows_wanted = sys.argv[1], int(sys.argv[2])
T, A, B = 8192, 2048, 16
ds = open_dataset(data)
stream = RowStream(ds.num_tokens, ds.sample, row_tokens=T, num_anchors=A, block_size=B, seed=0,
                   epochs=1, overlong="split", shuffle=True)
n_rows = stream.rows_in(0)
pick = np.linspace(0, n_rows - 1, rows_wanted).astype(int)
decay = torch.exp(-(torch.arange(B, dtype=torch.float32) - 1) / 7.0); decay[0] = 0
stats = {k: {"anchors": [], "slots": [], "full": [], "per_k": torch.zeros(B), "blocks": 0,
             "doclen_w": [], "wsum": []} for k in ("documents", "uniform", "speculators")}
cand_total = []
for i in pick.tolist():
    row = stream.row(int(i))
    loss, docs = row.loss_mask, row.doc_ids
    cand = anchor_candidates(loss, docs).nonzero().flatten()
    cand_total.append(len(cand))
    gen = torch.Generator().manual_seed(row_seed(0, 0, int(i)))
    # per-document lengths (in trained tokens) for each token
    doc_len = torch.zeros_like(docs)
    for d in torch.unique(docs).tolist():
        if d >= 0:
            sel = docs == d
            doc_len[sel] = int(loss[sel].sum())
    choices = {}
    choices["documents"] = sample_anchors(loss, docs, A, gen)
    u = cand[torch.randperm(len(cand), generator=gen)[:A]].sort().values
    choices["uniform"] = (u, torch.ones(len(u), dtype=torch.bool))
    sc = (loss != 0).nonzero().flatten(); sc = sc[sc < T - B]
    s = sc[torch.randperm(len(sc), generator=gen)[:A]].sort().values
    choices["speculators"] = (s, torch.ones(len(s), dtype=torch.bool))
    for name, (anch, valid) in choices.items():
        anch, valid = anch[valid], valid[valid]
        if name == "speculators":
            idx = (anch[:, None] + torch.arange(B)).clamp(max=T - 1)
            mask = (loss[idx] != 0).float(); mask[:, 0] = 0
        else:
            _, mask = block_labels(torch.zeros(1, len(anch), B - 1, dtype=torch.long), loss[None],
                                   docs[None], anch[None], valid[None], B)
            mask = mask[0]
        st = stats[name]
        st["anchors"].append(len(anch))
        st["slots"].append(float(mask.sum()))
        st["full"].append(float((mask[:, 1:].sum(1) == B - 1).sum()))
        st["per_k"] += mask.sum(0)
        st["blocks"] += len(anch)
        st["wsum"].append(float((mask * decay).sum()))
        st["doclen_w"].append(doc_len[anch].float())
print(f"rows sampled: {len(pick)} of {n_rows} (epoch 0, seed 0, T {T}, A {A}, B {B})")
print(f"candidates per row (loss_mask[a+1], same doc): mean {np.mean(cand_total):.0f}, "
      f"rows over A: {np.mean(np.array(cand_total) > A):.2f}")
print("| sampling | anchors/row | trained slots/block | blocks with all 15 | trained slots/row | decay-weighted slots/row | doc of an anchor, trained tokens: p10 / median / p90 |")
print("|---|---|---|---|---|---|---|")
for name, st in stats.items():
    a = np.sum(st["anchors"])
    dl = torch.cat(st["doclen_w"])
    print(f"| {name} | {np.mean(st['anchors']):.0f} | {np.sum(st['slots'])/a:.2f} | "
          f"{np.sum(st['full'])/a:.3f} | {np.mean(st['slots']):.0f} | {np.mean(st['wsum']):.0f} | "
          f"{dl.quantile(0.1).item():.0f} / {dl.median().item():.0f} / {dl.quantile(0.9).item():.0f} |")
print("\ntrained share of slot k over all blocks (k = 1, 2, 4, 8, 12, 15):")
for name, st in stats.items():
    r = st["per_k"] / st["blocks"]
    print(f"  {name:12s} " + " ".join(f"{r[k]:.3f}" for k in (1, 2, 4, 8, 12, 15)))
