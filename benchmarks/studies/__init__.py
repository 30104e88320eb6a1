"""One question each: kernel variants A/B, KV-cache precision, profiles."""
