"""How often speculators' rule trains a slot in another document than its anchor's, on the
reference run's packed rows (epoch 0, as training builds them): over every anchor its rule
allows (loss_mask[a] == 1, a < T - B), the slots k = 1..15 with loss_mask[a + k] == 1,
and among them those whose token is in a later document. flashdraft gives those slots
weight 0. Also counts the slots that reach another document at all, trained or not (the
count is not vacuous), and the fewest untrained tokens any document starts with: when that
is at least B - 1, no packing can give such a slot. No model: the rows only.

    .venv/bin/python benchmarks/raw/peer_gap_cpu_20261205_s27/scripts/cross_doc27.py DATA
"""

import sys

import torch

from flashdraft.data.dataset import open_dataset
from flashdraft.train.packing import RowStream

T, A, B = 8192, 2048, 16
ds = open_dataset(sys.argv[1])
stream = RowStream(ds.num_tokens, ds.sample, row_tokens=T, num_anchors=A, block_size=B, seed=0,
                   epochs=1, overlong="split", shuffle=True)
rows = stream.rows_in(0)
trained = crossing = rows_with = reaching = docs_seen = 0
shortest = T
for i in range(rows):
    row = stream.row(i)
    loss, docs = row.loss_mask.bool(), row.doc_ids
    anchors = loss[: T - B].nonzero().flatten()
    slots = anchors[:, None] + torch.arange(1, B)[None]  # [n, 15], all < T
    on = loss[slots]
    other = docs[slots] != docs[anchors][:, None]
    trained += int(on.sum())
    reaching += int(other.sum())  # slots in a later document, trained or not
    here = int((on & other).sum())
    crossing += here
    rows_with += here > 0
    for d in torch.unique(docs[docs >= 0]).tolist():  # untrained tokens a document starts with
        where = (docs == d).nonzero().flatten()
        first = loss[where].nonzero()
        if len(first):
            shortest, docs_seen = min(shortest, int(first[0])), docs_seen + 1
print(f"rows: {rows} (epoch 0, seed 0, T {T}); speculators' trained slots over all its anchors: "
      f"{trained}; in another document than the anchor: {crossing} ({crossing / trained:.2e}); "
      f"rows with any: {rows_with}; slots reaching another document at all (trained or "
      f"not): {reaching}; documents with a trained token: {docs_seen}, the fewest untrained "
      f"tokens one starts with: {shortest} (B - 1 = {B - 1} is the farthest a block reaches)")
