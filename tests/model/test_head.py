import torch
from torch import nn

from flashdraft.model.head import TargetHead


def test_chunked_argmax_at_equals_argmax_of_full_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    embedding = nn.Embedding(50, 8)
    head = TargetHead(embedding=embedding, weight=torch.randn(50, 8, generator=gen), softcap=3.0)
    hidden = torch.randn(2, 12, 8, generator=gen)
    positions = torch.randint(0, 12, (2, 4, 3), generator=gen)
    # Chunks of 5 rows over 12 picked rows per call: uneven last chunk on purpose.
    picked = head.argmax_at(hidden, positions, chunk_rows=5)
    rows = hidden.gather(1, positions.reshape(2, -1, 1).expand(-1, -1, 8))
    assert picked.shape == positions.shape
    assert torch.equal(picked, head.logits(rows).argmax(-1).view(positions.shape))
