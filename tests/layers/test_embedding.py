"""The token embedding's lookup: every batch size gives F.embedding's rows (on CUDA, 2 to
16 ids go through indexing's gather instead of index_select)."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers.embed_head import VocabParallelEmbedding

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_lookup_equals_f_embedding_at_every_batch_size(device: str) -> None:
    embedding = VocabParallelEmbedding(1000, 64).to(device)
    embedding.weight.data.normal_()
    for n in (1, 2, 9, 16, 17, 64):
        ids = torch.randint(0, 1000, (n,), device=device)
        assert torch.equal(embedding(ids), F.embedding(ids, embedding.weight))
