"""Scale-out: kvwise engine replicas on Ray Serve behind one OpenAI-compatible ingress, sharing
prefix KV through Redis (Cluster), routed by where each prefix's blocks are (`pip install
"kvwise[cluster]"`). Only `launch`, `replica` and `routers` import Ray."""
