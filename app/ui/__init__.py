"""The web dashboard at /ui: server-rendered pages (Jinja2), small vanilla JS files for the live
parts, signed in with an API key exchanged for a server-side session (HttpOnly cookie)."""
