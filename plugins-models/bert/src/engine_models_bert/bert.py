"""BERT encoder for pooling (``--task embed``): bidirectional attention over each whole prompt.

The scheduler hands a packed batch (every row's tokens back to back, ``extend_seq_lens_cpu``
per row, never a cached prefix or a chunk: encoders declare ``uses_kv_cache = False``). Each
layer pads the rows into one ``[rows, longest, ...]`` block for torch's scaled-dot-product
attention with a key-padding mask and packs the result again; no KV is stored. Token type ids
are zero (single-segment inputs, as sentence-transformers sends) unless the batch carries a
text pair's (``forward_batch.extra["token_type_ids"]``, cross-encoders); positions are absolute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.model_executor.forward_batch import ForwardBatch

_ACTIVATIONS = {
    "gelu": lambda x: nn.functional.gelu(x),
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": nn.functional.relu,
}


class RowLayout:
    """Where each row's tokens sit in the packed batch and in the padded block."""

    def __init__(self, lens: list[int], device: torch.device) -> None:
        self.lens = lens
        self.longest = max(lens)
        rows = torch.repeat_interleave(torch.arange(len(lens), device=device),
                                       torch.tensor(lens, device=device))
        starts = torch.tensor([0, *lens[:-1]], device=device).cumsum(0)
        cols = torch.arange(rows.numel(), device=device) - starts[rows]
        # Flat index of each packed token in the padded [rows * longest] block.
        self.flat = rows * self.longest + cols
        # [rows, 1, 1, longest]: True where a key is a real token of the row.
        keys = torch.arange(self.longest, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        self.key_mask = keys[:, None, None, :]

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        out = packed.new_zeros((len(self.lens) * self.longest, *packed.shape[1:]))
        out[self.flat] = packed
        return out.view(len(self.lens), self.longest, *packed.shape[1:])

    def unpack(self, padded: torch.Tensor) -> torch.Tensor:
        return padded.reshape(len(self.lens) * self.longest, *padded.shape[2:])[self.flat]


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        def heads(x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [rows, heads, longest, head_dim]
            return layout.pad(x.view(-1, self.num_heads, self.head_dim)).transpose(1, 2)

        q, k, v = heads(self.query(hidden)), heads(self.key(hidden)), heads(self.value(hidden))
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.key_mask,
                                                         scale=1.0 / math.sqrt(self.head_dim))
        return layout.unpack(out.transpose(1, 2)).reshape(hidden.shape)


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.attention = nn.Module()
        self.attention.self = BertSelfAttention(config)
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=eps)
        act = config.hidden_act
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"BERT hidden_act {act!r} is not supported; accepted: {', '.join(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]

    def forward(self, hidden: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        att = self.attention.output
        hidden = att.LayerNorm(att.dense(self.attention.self(hidden, layout)) + hidden)
        inner = self.act(self.intermediate.dense(hidden))
        return self.output.LayerNorm(self.output.dense(inner) + hidden)


class BertModel(nn.Module):
    """The encoder; ``forward_hidden`` returns the last hidden state of every token."""

    #: Bidirectional: the scheduler keeps no KV for it, never chunks a prompt and never reuses a prefix.
    uses_kv_cache = False

    def __init__(self, config: Any, quant_config: Any = None, options: dict[str, Any] | None = None) -> None:
        super().__init__()
        if quant_config is not None:
            raise ModelLoadError("the BERT plugin runs unquantized weights only; drop --quant")
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"BERT position_embedding_type {config.position_embedding_type!r} is not "
                                 "supported; accepted: absolute")
        self.config = config
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embeddings.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.embeddings.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embeddings.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        # BertModel's pooler (tanh of a dense layer on the first token); absent from some checkpoints.
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.has_pooler = True

    @torch.no_grad()
    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       forward_batch: ForwardBatch) -> torch.Tensor:
        lens = forward_batch.extend_seq_lens_cpu or [int(input_ids.numel())]
        layout = RowLayout(list(lens), input_ids.device)
        emb = self.embeddings
        # Segment ids come with text pairs (cross-encoders); single texts are segment 0.
        types = forward_batch.extra.get("token_type_ids")
        segment = emb.token_type_embeddings(types) if types is not None else emb.token_type_embeddings.weight[0]
        hidden = emb.word_embeddings(input_ids) + emb.position_embeddings(positions) + segment
        hidden = emb.LayerNorm(hidden)
        for layer in self.encoder.layer:
            hidden = layer(hidden, layout)
        return hidden

    def pooled_output(self, first_token_states: torch.Tensor) -> torch.Tensor:
        """BertModel's ``pooler_output`` from the rows' first-token states."""
        if not self.has_pooler:
            raise ModelLoadError("this BERT checkpoint has no pooler weights (pooler.dense)")
        return torch.tanh(self.pooler.dense(first_token_states))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> Any:
        raise ModelLoadError("a BERT encoder generates no text; serve it with --task embed")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("bert."):  # BertForMaskedLM and friends keep the encoder under bert.
                name = name[len("bert."):]
            if name.startswith("cls.") or name.endswith("position_ids"):
                continue  # the masked-LM head and a buffer of 0..n-1
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor '{name}' has no matching parameter in BertModel")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)}; "
                                     f"BertModel expects {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
        self.has_pooler = "pooler.dense.weight" in loaded
        missing = sorted(n for n in params if n not in loaded and not n.startswith("pooler."))
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} parameters, e.g. {', '.join(missing[:3])}")


class BertForMaskedLM(BertModel):
    """A masked-LM checkpoint served by its encoder (the LM head is not loaded)."""


_CLASSES = {cls.__name__: cls for cls in (BertModel, BertForMaskedLM)}


def model_class_for(architecture: str) -> type[nn.Module]:
    return _CLASSES[architecture]
