"""attention and attention_varlen: dense and packed (varlen) attention, forward and backward
(api.py; semantics in reference.py)."""
