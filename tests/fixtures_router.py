"""Factory fixtures that start routers on 127.0.0.1, port 0 (owned by the router work)."""
