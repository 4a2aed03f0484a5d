"""KV tiers below VRAM: units and their checksummed format, the RAM and disk stores, queue-aware eviction.

Pure Python (no Ray): the tier actors in `actors/kv_tier_actors.py` own these objects.
"""
