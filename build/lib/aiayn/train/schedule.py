"""The paper's learning-rate schedule, and what a training step costs in FLOPs.

docs/PAPER.md, Training: ``lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`` (the schedule a
checkpoint records beside it). FLOP counts of a step feed ``train_flops`` and the model FLOPs utilisation.
"""

from __future__ import annotations

from aiayn.model import ModelConfig


def learning_rate(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """docs/PAPER.md, Training: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def schedule_record(d_model: int, warmup_steps: int, scale: float) -> dict:
    """The schedule as a training checkpoint records it."""
    return {"kind": "inverse_sqrt_warmup", "d_model": d_model, "warmup_steps": warmup_steps, "scale": scale}


def forward_flops(config: ModelConfig, rows: int, src_len: int, tgt_len: int) -> float:
    """Multiply-add FLOPs (x2) of one forward pass over a padded batch, as the hardware does them."""
    d, h, dk, dv, ff, n = config.d_model, config.n_heads, config.head_dim, config.value_dim, config.d_ff, config.n_layers
    attention_proj = 2 * d * (2 * h * dk + h * dv) + 2 * h * dv * d  # q, k, v and output projections
    ffn = 4 * d * ff
    encoder = rows * src_len * (attention_proj + ffn) + rows * h * src_len * src_len * 2 * (dk + dv)
    decoder = (rows * tgt_len * (attention_proj + 2 * d * h * dk + 2 * h * dv * d + ffn)
               + rows * src_len * 2 * d * (h * dk + h * dv)
               + rows * h * tgt_len * (tgt_len + src_len) * 2 * (dk + dv))
    output = rows * tgt_len * 2 * d * config.vocab_size
    return float(n * (encoder + decoder) + output)
