"""Pretrained transformers running on attnkit's attention.

    encoder = attnkit.models.load("minilm")          # all-MiniLM-L6-v2, bundled in a pip package
    out = encoder.encode(["A sentence.", "Another one."], need_weights=True)
    out.hidden_states   # [B, T, 384]; out.attentions: 6 x [B, 12, T, T]
"""

from .bert import BertConfig, BertEncoder, BertEmbeddings, BertLayer
from .encoder import Encoded, TextEncoder, load

__all__ = ["load", "TextEncoder", "Encoded", "BertConfig", "BertEncoder", "BertEmbeddings", "BertLayer"]
