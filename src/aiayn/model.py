"""The Transformer of "Attention Is All You Need", read as the paper's Figure 1.

Top-down: the config, then scaled dot-product attention (Eq. 1) and multi-head attention (Section 3.2),
the position-wise feed-forward network (3.3), embeddings with positions (3.4, 3.5), the encoder and
decoder layers (3.1), and the ``Transformer`` that stacks them. The paper alone: what exists for speed
(the decoder's cache, packed weights, CPU kernels) lives in the ``aiayn.speed`` wing, which imports
this module.

Imports torch alone, so that it runs on a bare GPU image with ``PYTHONPATH=src``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.errors import UserError
from aiayn.tokens import PAD_ID

POSITIONAL_KINDS = ("sinusoidal", "learned", "none")
INIT_KINDS = ("t2t", "fairseq")


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, with the paper's names; the defaults are the base model (Table 3, first row)."""

    vocab_size: int
    n_layers: int = 6
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8
    d_head: int | None = None  # d_k, query/key size per head; None means d_model // n_heads
    d_value: int | None = None  # d_v, value size per head; None means d_head (Table 3 row B changes d_k alone)
    dropout: float = 0.1
    positional: str = "sinusoidal"  # one of POSITIONAL_KINDS; "learned" is Table 3 row E
    max_positions: int = 1024  # rows of the learned table; initial length of the sinusoid table, which grows
    pad_id: int = PAD_ID
    init: str = "t2t"  # one of INIT_KINDS: the paper gives no initialisation (see Transformer._init_weights)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layers", "d_model", "d_ff", "n_heads", "max_positions"):
            _require_int(name, getattr(self, name), minimum=1)
        for name in ("d_head", "d_value"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), minimum=1)
        _require_int("pad_id", self.pad_id, minimum=0)
        if self.pad_id >= self.vocab_size:
            raise UserError(
                f"pad_id = {self.pad_id} is not a token of a vocabulary of vocab_size = {self.vocab_size} "
                f"(pad_id must be below vocab_size)"
            )
        check_heads(self.n_heads, self.d_model, self.d_head)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise UserError(f"dropout = {self.dropout!r} must be a number in [0, 1)")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout = {self.dropout} must be in [0, 1) (the paper uses 0.1 for base, 0.3 for big)")
        if self.positional not in POSITIONAL_KINDS:
            raise UserError(
                f"positional = {self.positional!r} is unknown (choose one of {', '.join(POSITIONAL_KINDS)})"
            )
        if self.init not in INIT_KINDS:
            raise UserError(f"init = {self.init!r} is unknown (choose one of {', '.join(INIT_KINDS)})")

    @property
    def head_dim(self) -> int:
        """d_k: the query and key size of one head."""
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads

    @property
    def value_dim(self) -> int:
        """d_v: the value size of one head."""
        return self.d_value if self.d_value is not None else self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise UserError(
                f"unknown model setting(s): {', '.join(unknown)} (known: {', '.join(known)})"
            )
        if "vocab_size" not in values:
            raise UserError("vocab_size is missing from the model settings (it comes from the vocabulary)")
        return cls(**values)


def check_heads(n_heads: int, d_model: int, d_head: int | None, setting: str = "n_heads") -> None:
    """Section 3.2.2's d_k = d_model / h: without an explicit d_head, n_heads must divide d_model.

    The model's own rule (a config's presets are held to the same one where they are read, naming the
    file: ``aiayn.config``); ``setting`` names the value in the message."""
    if d_head is None and d_model % n_heads:
        divisors = [n for n in range(1, d_model + 1) if d_model % n == 0]
        choices = ", ".join(str(n) for n in divisors[:5]) + (", ..." if len(divisors) > 5 else "")
        raise UserError(f"{setting} = {n_heads} does not divide d_model = {d_model} "
                        f"(set d_head explicitly, or choose n_heads in {choices})")


def _require_int(name: str, value: Any, minimum: int) -> None:
    # bool is an int subclass, but `n_layers: true` in a config file is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{name} = {value!r} must be a whole number (at least {minimum})")
    if value < minimum:
        raise UserError(f"{name} = {value} must be at least {minimum}")


def scaled_dot_product_attention(
    queries: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None = None, causal: bool = False
) -> Tensor:
    """Section 3.2.1, Eq. 1: Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, for every head at once.

    queries (batch, heads, tgt_len, d_k), keys (batch, heads, src_len, d_k), values (batch, heads,
    src_len, d_v) -> (batch, heads, tgt_len, d_v). key_mask is True where a key may be attended to
    (broadcast over heads and queries); causal hides the keys after each query's position (3.2.3).
    The one definition of attention: the faster kernels of ``aiayn.speed`` are tested against it.
    """
    # SDPA's default scale is 1/sqrt of the query size, d_k. No dropout on the attention weights: the
    # paper drops only sub-layer outputs and embedding sums (Section 5.4); the attention-dropout of
    # some t2t hparams sets is not in the paper.
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=key_mask, is_causal=causal)


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: h heads of scaled dot-product attention (Eq. 1), concatenated and projected by W^O.

    Split into projections (queries, keys and values) and `attend`, so that a cached decoder can
    project the encoder's keys and values once and add one self-attention key and value per step.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.value_dim = config.value_dim
        self.query = nn.Linear(config.d_model, config.n_heads * config.head_dim)
        self.key = nn.Linear(config.d_model, config.n_heads * config.head_dim)
        self.value = nn.Linear(config.d_model, config.n_heads * config.value_dim)
        self.output = nn.Linear(config.n_heads * config.value_dim, config.d_model)  # W^O

    def forward(self, x: Tensor, source: Tensor, key_mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """x (batch, tgt_len, d_model) attends to source (batch, src_len, d_model); source is x for self-attention."""
        if source is x:
            return self.attend(*self.self_projections(x), key_mask, causal)
        keys, values = self.keys_values(source)
        return self.attend(self.queries(x), keys, values, key_mask, causal)

    def self_projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K and V of self-attention in one matrix multiply (one GEMM three times as wide is
        faster than three); the weights stay three Linear layers, so checkpoints are unchanged."""
        parts = (self.query, self.key, self.value)
        weight = torch.cat([part.weight for part in parts])
        bias = torch.cat([part.bias for part in parts])
        return self.split_self_projections(F.linear(x, weight, bias))

    def split_self_projections(self, projected: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(batch, len, heads * (2 d_head + d_value)), Q, K and V side by side -> each as (batch, heads, len, d)."""
        key_size = self.n_heads * self.head_dim
        queries, keys, values = projected.split([key_size, key_size, self.n_heads * self.value_dim], dim=-1)
        return (self.split_heads(queries, self.head_dim), self.split_heads(keys, self.head_dim),
                self.split_heads(values, self.value_dim))

    def queries(self, x: Tensor) -> Tensor:
        return self.split_heads(self.query(x), self.head_dim)  # (batch, heads, tgt_len, d_head)

    def keys_values(self, source: Tensor) -> tuple[Tensor, Tensor]:
        keys = self.split_heads(self.key(source), self.head_dim)  # (batch, heads, src_len, d_head)
        values = self.split_heads(self.value(source), self.value_dim)  # (batch, heads, src_len, d_value)
        return keys, values

    def attend(
        self, queries: Tensor, keys: Tensor, values: Tensor, key_mask: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        heads = scaled_dot_product_attention(queries, keys, values, key_mask, causal)  # Eq. 1, every head
        return self.output(self.merge_heads(heads))  # (batch, tgt_len, d_model)

    def split_heads(self, projected: Tensor, size: int) -> Tensor:
        """(batch, len, heads * size) -> (batch, heads, len, size)."""
        batch, length, _ = projected.shape
        return projected.view(batch, length, self.n_heads, size).transpose(1, 2)

    def merge_heads(self, heads: Tensor) -> Tensor:
        """(batch, heads, len, d_value) -> (batch, len, heads * d_value): Concat(head_1, ..., head_h)."""
        batch, _, length, _ = heads.shape
        return heads.transpose(1, 2).reshape(batch, length, self.n_heads * self.value_dim)


def key_padding_mask(src_pad: Tensor) -> Tensor:
    """(batch, src_len) True at pad -> (batch, 1, 1, src_len) True where a query may attend.

    Broadcast over heads and queries by SDPA, so no (batch, heads, tgt_len, src_len) mask is built.
    """
    return ~src_pad[:, None, None, :]


class FeedForward(nn.Module):
    """Eq. 2: FFN(x) = max(0, x W1 + b1) W2 + b2, the same at every position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inner = nn.Linear(config.d_model, config.d_ff)
        self.outer = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(F.relu(self.inner(x)))


def sinusoid_table(length: int, d_model: int) -> Tensor:
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(the same angle).

    Computed in float64 so that positions in the thousands keep their low-order bits, then cast to float32.
    """
    positions = torch.arange(length, dtype=torch.float64)[:, None]  # (length, 1)
    even = torch.arange(0, d_model, 2, dtype=torch.float64)  # the 2i of the formula
    angles = positions / torch.pow(10000.0, even / d_model)  # (length, ceil(d_model / 2))
    table = torch.empty(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table.float()


class PositionalEncoding(nn.Module):
    """Adds position information to the scaled embeddings: sinusoids (Section 3.5), a learned table
    (Table 3 row E) or nothing (an ablation that makes the encoder blind to order)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.kind = config.positional
        self.max_positions = config.max_positions
        if self.kind == "sinusoidal":
            # Not persistent: it is a function of the config, so checkpoints need not carry it.
            self.register_buffer("table", sinusoid_table(config.max_positions, config.d_model), persistent=False)
        elif self.kind == "learned":
            self.learned = nn.Embedding(config.max_positions, config.d_model)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        end = offset + x.shape[1]  # x: (batch, len, d_model), positions offset .. end - 1
        if self.kind == "sinusoidal":
            if end > self.table.shape[0]:
                # The sinusoids extrapolate to any length (Section 3.5), so the table grows instead of failing.
                grown = sinusoid_table(max(end, 2 * self.table.shape[0]), self.table.shape[1])
                self.table = grown.to(self.table)
            return x + self.table[offset:end]
        if self.kind == "learned":
            if end > self.max_positions:
                raise UserError(
                    f"a sequence reaches position {end - 1}, past the learned table of "
                    f"max_positions = {self.max_positions} (raise max_positions, or use positional = sinusoidal)"
                )
            return x + self.learned.weight[offset:end]
        return x


class EncoderLayer(nn.Module):
    """Section 3.1: self-attention then feed-forward, each as LayerNorm(x + Dropout(Sublayer(x))).

    Beam search runs this forward over stand-ins for these parts (``aiayn.speed.incremental``, which
    declares them in ENCODER_LAYER_PARTS; tests/speed/test_incremental.py fails when they differ).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attention = MultiHeadAttention(config)
        self.self_attention_norm = nn.LayerNorm(config.d_model)
        self.feed_forward = FeedForward(config)
        self.feed_forward_norm = nn.LayerNorm(config.d_model)
        self.dropout = nn.Dropout(config.dropout)  # residual dropout, Section 5.4

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        # Post-norm, as the paper (the Annotated Transformer and later t2t are pre-norm).
        x = self.self_attention_norm(x + self.dropout(self.self_attention(x, x, src_mask)))
        return self.feed_forward_norm(x + self.dropout(self.feed_forward(x)))


class DecoderLayer(nn.Module):
    """Section 3.1: masked self-attention, encoder-decoder attention, feed-forward; each post-norm.

    Its parts are declared for the cached decoder step in ``aiayn.speed.incremental.DECODER_LAYER_PARTS``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attention = MultiHeadAttention(config)
        self.self_attention_norm = nn.LayerNorm(config.d_model)
        self.cross_attention = MultiHeadAttention(config)
        self.cross_attention_norm = nn.LayerNorm(config.d_model)
        self.feed_forward = FeedForward(config)
        self.feed_forward_norm = nn.LayerNorm(config.d_model)
        self.dropout = nn.Dropout(config.dropout)  # residual dropout, Section 5.4

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        # Section 3.2.3: position t sees only positions <= t. Targets are right-padded, so a real token
        # never sees a pad, and the causal mask alone is exact for every non-pad output.
        x = self.self_attention_norm(x + self.dropout(self.self_attention(x, x, causal=True)))
        x = self.cross_attention_norm(x + self.dropout(self.cross_attention(x, memory, src_mask)))
        return self.feed_forward_norm(x + self.dropout(self.feed_forward(x)))


class Transformer(nn.Module):
    """The encoder-decoder of Figure 1, with one embedding matrix for source, target and output (Section 3.4)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Section 3.4: this one matrix embeds source tokens, embeds target tokens, and (transposed) is the
        # pre-softmax linear layer; `project` uses it directly, with no bias and no separate parameter.
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.embedding_scale = math.sqrt(config.d_model)  # Section 3.4: embeddings times sqrt(d_model)
        self.positional = PositionalEncoding(config)
        self.embedding_dropout = nn.Dropout(config.dropout)  # on embedding + position sums, Section 5.4
        self.encoder = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self._init_weights()

    def _init_weights(self) -> None:
        """The paper gives no initialisation; ``config.init`` picks one of two common ones.

        "t2t" (tensor2tensor's): Xavier-uniform for every linear map, biases 0. "fairseq" (fairseq 0.12's):
        Xavier-uniform with gain 1/sqrt(2) for the query, key and value maps (their biases torch's default),
        Xavier-uniform for W^O with bias 0, torch's default for the feed-forward layers. Both: the shared
        embedding N(0, d_model^-0.5) with the padding row 0.
        """
        for module in self.modules():
            if self.config.init == "t2t" and isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif self.config.init == "fairseq" and isinstance(module, MultiHeadAttention):
                for linear in (module.query, module.key, module.value):
                    nn.init.xavier_uniform_(linear.weight, gain=2**-0.5)
                nn.init.xavier_uniform_(module.output.weight)
                nn.init.zeros_(module.output.bias)
        # Std d_model^-0.5: after the sqrt(d_model) scale the inputs have unit variance, and the tied
        # pre-softmax layer starts with small logits (t2t and fairseq, for the shared, scaled embedding).
        nn.init.normal_(self.embedding.weight, mean=0.0, std=self.config.d_model**-0.5)
        with torch.no_grad():
            self.embedding.weight[self.config.pad_id].zero_()
        if self.config.positional == "learned":
            nn.init.normal_(self.positional.learned.weight, mean=0.0, std=self.config.d_model**-0.5)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing: src (batch, src_len), tgt_in (batch, tgt_len) -> logits (batch, tgt_len, vocab)."""
        memory, src_pad = self.encode(src)
        return self.project(self.decode(tgt_in, memory, src_pad))

    def embed(self, tokens: Tensor, offset: int = 0) -> Tensor:
        """(batch, len) token ids at positions offset.. -> (batch, len, d_model) stack inputs."""
        scaled = self.embedding(tokens) * self.embedding_scale
        return self.embedding_dropout(self.positional(scaled, offset))

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (batch, src_len) -> memory (batch, src_len, d_model) and src_pad (batch, src_len), True at pad."""
        src_pad = src.eq(self.config.pad_id)
        src_mask = key_padding_mask(src_pad)
        x = self.embed(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return x, src_pad

    def decode(self, tgt_in: Tensor, memory: Tensor, src_pad: Tensor) -> Tensor:
        """tgt_in (batch, tgt_len) -> hidden (batch, tgt_len, d_model); `project` turns it into logits."""
        src_mask = key_padding_mask(src_pad)
        x = self.embed(tgt_in)
        for layer in self.decoder:
            x = layer(x, memory, src_mask)
        return x

    def project(self, hidden: Tensor) -> Tensor:
        """(..., d_model) -> logits (..., vocab): the pre-softmax layer is the shared embedding, no bias."""
        return F.linear(hidden, self.embedding.weight)

    def num_parameters(self) -> int:
        """Distinct parameters; the shared embedding counts once (it is one Parameter)."""
        return sum(parameter.numel() for parameter in self.parameters())
