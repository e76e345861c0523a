"""The adaptive controller: profiles of what each KV mix costs and keeps, and the part that chooses."""
