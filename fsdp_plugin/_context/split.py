"""Which sequence positions a context-parallel rank computes, and the split of one forward's inputs.

Load balance for causal masks (the head-tail / zigzag layout): the sequence, padded to a multiple of 2C, is cut
into 2C equal chunks and CP rank r keeps chunks r and 2C-1-r, so every rank holds the same number of visible
(query, key) pairs under a causal mask. The padding is never silent and never changes the result: padded
tokens are invalid keys (``Layout.key_valid``) and carry label -100.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import UsageError

IGNORE = -100       # transformers' ignore_index
# the edge of an attention tile (query rows x keys, ``tiles.py``): a tile's fp32 scores are B*H*BLOCK**2*4 bytes
# (32 MiB at 32 heads), whatever the sequence length
BLOCK = 512
# the per-token inputs this module splits; any other (batch, length) tensor is refused by name
SPLIT = ("input_ids", "inputs_embeds", "position_ids", "attention_mask", "labels", "shift_labels")


def chunk_order(seq_len: int, cp: int) -> tuple[int, int]:
    """(padded length, chunk length): the length padded up to a multiple of 2*cp, and a chunk of it."""
    chunk = -(-seq_len // (2 * cp))
    return 2 * cp * chunk, chunk


def positions(cp_rank: int, cp: int, chunk: int) -> torch.Tensor:
    """Sequence indices (into the padded sequence) of CP rank ``cp_rank``'s tokens: chunks r and 2C-1-r."""
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    tail = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([head, tail])


@dataclass
class Layout:
    """One forward's split, shared by every attention layer of it (passed down as a keyword argument).

    ``q_index``: this rank's positions; ``kv_index``: the positions of the all-gathered keys (every rank's
    ``q_index``, rank order); ``key_valid``/``doc``: per padded position, whether it is a real, unpadded key and
    its packed document (None: one document per row), (batch, padded length)."""
    group: object
    cp: int
    cp_rank: int
    seq_len: int
    padded: int
    q_index: torch.Tensor
    kv_index: torch.Tensor
    key_valid: torch.Tensor
    doc: Optional[torch.Tensor] = None
    method: str = "allgather"      # ShardingConfig.context_parallel_attention
    block: int = BLOCK              # attention tile edge (``tiles.py``); each 2C chunk is cut into tiles of <= block
    _masks: dict = field(default_factory=dict)

    def mask(self, causal: bool, window: Optional[int], device, all_queries: bool = False) -> torch.Tensor:
        """(batch, 1, local, padded) bool, True = attend, in the gathered key order; built once per forward and
        kind of layer. transformers' rules: causal ``k <= q``, sliding window ``k > q - window``, padding masks
        keys, packed documents attend within themselves. A query that sees no key (a left-padded one) stays
        fully masked: torch's SDPA gives it output 0, as in one process (its label may still count: a collator's
        last pad predicts the first real token)."""
        key = (causal, window, str(device), all_queries)
        if key not in self._masks:
            queries = self.kv_index if all_queries else self.q_index
            self._masks[key] = self._allowed(queries, self.kv_index, causal, window)[:, None].to(device)
        return self._masks[key]

    def block_mask(self, causal: bool, window: Optional[int], rows: slice, keys: slice) -> torch.Tensor:
        """(batch, len(rows), len(keys)) bool, True = attend: the part of ``mask`` for this rank's local query
        rows ``rows`` and gathered keys ``keys`` (slices), built alone so that no (local × S) tensor exists."""
        return self._allowed(self.q_index[rows], self.kv_index[keys], causal, window)

    def _allowed(self, queries: torch.Tensor, keys: torch.Tensor, causal: bool, window: Optional[int]):
        """(batch, queries, keys) bool on CPU for the given padded positions (see ``mask``)."""
        q, k = queries[:, None], keys[None, :]
        allowed = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool)
        if causal:
            allowed &= k <= q
        if window is not None:
            allowed &= k > q - window
        allowed = allowed[None] & self.key_valid[:, keys][:, None, :]
        if self.doc is not None:
            allowed &= self.doc[:, queries][:, :, None] == self.doc[:, keys][:, None, :]
        return allowed

    def local(self, full: torch.Tensor, pad_value) -> torch.Tensor:
        """This rank's positions of a (batch, length, ...) tensor, padded with ``pad_value`` first."""
        extra = self.padded - full.shape[1]
        if extra:
            pad = [0, 0] * (full.dim() - 2) + [0, extra]
            full = F.pad(full, pad, value=pad_value)
        return full[:, self.q_index.to(full.device)]


def make_layout(group, cp: int, cp_rank: int, batch: int, seq_len: int, attention_mask, position_ids,
                packed_fn, method: str = "allgather") -> Layout:
    padded, chunk = chunk_order(seq_len, cp)
    kv_index = torch.cat([positions(r, cp, chunk) for r in range(cp)])
    valid = torch.ones(batch, seq_len, dtype=torch.bool) if attention_mask is None \
        else attention_mask.detach().to("cpu", torch.bool).expand(batch, seq_len)
    valid = F.pad(valid, (0, padded - seq_len), value=False)
    doc = None
    if attention_mask is None and position_ids is not None:   # transformers' rule: packing only without a mask
        found = packed_fn(position_ids.detach().cpu().expand(batch, -1))
        if found is not None:
            doc = F.pad(found, (0, padded - seq_len), value=-1)
    return Layout(group, cp, cp_rank, seq_len, padded, positions(cp_rank, cp, chunk), kv_index, valid, doc, method)


def split_inputs(kwargs: dict, layout: Layout, causal_lm: bool) -> dict:
    """The model's keyword arguments for this rank: per-token inputs at its positions, global position ids,
    labels shifted BEFORE the split (a label at a chunk border belongs to the token before it), and the
    global valid-label count as ``num_items_in_batch`` (unless given) so that local sums add up to the loss."""
    out = dict(kwargs)
    ids, emb = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    batch, seq = layout.key_valid.shape[0], layout.seq_len
    if ids is not None:
        out["input_ids"] = layout.local(ids, 0)
    if emb is not None:
        out["inputs_embeds"] = layout.local(emb, 0.0)
    ref = ids if ids is not None else emb
    pos = kwargs.get("position_ids")
    if pos is None:
        pos = torch.arange(seq, device=ref.device)[None].expand(batch, -1)
    # padded tokens continue the positions (they are masked keys: their values only have to be valid indices)
    tail = pos[:, -1:] + torch.arange(1, layout.padded - seq + 1, device=pos.device)
    full = torch.cat([pos.expand(batch, -1), tail.expand(batch, -1)], 1)
    out["position_ids"] = full[:, layout.q_index.to(pos.device)]
    if kwargs.get("attention_mask") is not None:
        out["attention_mask"] = layout.local(kwargs["attention_mask"], 0)
    labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
    if labels is not None or shift is not None:
        if not causal_lm:
            raise UsageError("context_parallel with labels= needs a causal LM loss (a *ForCausalLM model, "
                             "transformers' ForCausalLMLoss): compute other losses from the gathered outputs "
                             "(fp.gather_sequence) instead")
        if shift is None:    # transformers' own shift (loss_utils.ForCausalLMLoss), on the whole sequence
            shift = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
        local = layout.local(shift, IGNORE).contiguous()
        out["labels"] = out["shift_labels"] = local
        if kwargs.get("num_items_in_batch") is None:
            out["num_items_in_batch"] = (shift != IGNORE).sum()
    return out


def check_inputs(kwargs: dict, seq_len: int, batch: int) -> None:
    """Refuse what a split would get wrong: a prepared 4-D mask, a KV cache, an unknown per-token tensor."""
    mask = kwargs.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        raise UsageError("context_parallel: attention_mask must be the 2-D (batch, length) padding mask; a "
                         "prepared 4-D mask or BlockMask cannot be split (pass position_ids restarts for packed "
                         "documents instead)")
    if kwargs.get("past_key_values") is not None:
        raise UsageError("context_parallel: past_key_values (generation with a KV cache) is not split; generate "
                         "with a model sharded without context_parallel")
    for name, value in kwargs.items():
        if name not in SPLIT and isinstance(value, torch.Tensor) and value.dim() >= 2 \
                and tuple(value.shape[:2]) == (batch, seq_len):
            raise UsageError(f"context_parallel: {name}= looks per-token (shape {tuple(value.shape)}) but is not "
                             f"one of the inputs split over the sequence ({', '.join(SPLIT)}); drop it, or "
                             "shard without context_parallel")
