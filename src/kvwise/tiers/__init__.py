"""Storage tiers for KV blocks below the device: host RAM, local disk, Redis."""
