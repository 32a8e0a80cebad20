"""`hotswap route URL...`: one OpenAI-compatible front end over several `hotswap serve`
instances (see app.py)."""
