"""Vocabulary-parallel embedding and LM head: each rank holds a slice of the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import divide
from nanovllm.utils.context import get_context
from nanovllm.utils.distributed import get_tp_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.size
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size)
        self.vocab_start_idx = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_idx = self.vocab_start_idx + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = param.size(0)
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * shard, shard))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's slice. torch's index_select (F.embedding's path) takes a kernel
        of its own for 2 to 16 ids on CUDA, slower there than indexing's gather
        (RESULTS.md, session 21)."""
        if ids.is_cuda and 1 < ids.numel() <= 16:
            return self.weight[ids]
        return F.embedding(ids, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(x)
        # Ids outside this rank's slice look up row 0 and are zeroed; the all-reduce fills them in.
        mask = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = self.lookup(mask * (x - self.vocab_start_idx))
        y = y * mask.unsqueeze(1)
        self.tp_group.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of the last token of each sequence; rank 0 gathers the vocabulary slices."""

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """`out` ([num_seqs, vocab], one rank only): write the logits there instead of a new
        tensor (the decode graphs' static buffer; saves a copy)."""
        context = get_context()
        if context.is_prefill:
            # x packs every scheduled token; only the last of each sequence is sampled (and drafts' rows).
            rows = context.logit_rows if context.logit_rows is not None else context.cu_seqlens_q[1:] - 1
            x = x[rows].contiguous()
        if out is not None:
            assert self.tp_size == 1, "logits go to `out` on one rank only"
            return torch.mm(x, self.weight.t(), out=out)
        return self.project(x)

    def project(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits of every row of x: [rows, vocab] on rank 0, None on the others (every rank
        calls it: rank 0 gathers their slices)."""
        logits = F.linear(x, self.weight)  # [rows, vocab / tp]
        if self.tp_size == 1:
            return logits
        gathered = self.tp_group.gather(logits)
        return torch.cat(gathered, -1) if gathered is not None else None
