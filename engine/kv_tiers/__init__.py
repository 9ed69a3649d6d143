"""Optional component: KV tiers below the KV tensor: the disk tier (disk_tier.py), its files
(block_file.py), and the copies between the KV tensor and host memory (block_copy.py)."""
