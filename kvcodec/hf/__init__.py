"""kvcodec.hf: a Hugging Face ``transformers`` cache that holds compressed K/V and attends on it.

    from kvcodec.hf import CompressedCache
    cache = CompressedCache(model, method="turboquant", key_bits=4, value_bits=3)
    out = model.generate(ids, cache=cache, max_new_tokens=64)  # past_key_values= before transformers 5.24
    cache.nbytes(), cache.memory_report(), cache.save("prefix.kvc")
"""

from kvcodec.hf.attention import NAME, AttentionOptions, compressed_attention, disable, enable, register, use
from kvcodec.hf.cache import CompressedCache, CompressedLayer
from kvcodec.hf.methods import METHODS
from kvcodec.hf.static_cache import StaticCompressedCache

__all__ = [
    "AttentionOptions",
    "CompressedCache",
    "CompressedLayer",
    "METHODS",
    "StaticCompressedCache",
    "NAME",
    "compressed_attention",
    "disable",
    "enable",
    "register",
    "use",
]
