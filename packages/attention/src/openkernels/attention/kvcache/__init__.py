"""Attention against a KV cache: attention_with_kvcache (api.py), the KVCache class (cache.py),
the int8 / int4 / fp8 cache formats (format.py) and the transformers Caches (hf.py)."""
